package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/cookiejar"
	"strings"
	"testing"

	"github.com/oncely/oncely/internal/pgtest"
)

func TestConsoleBadUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"console", "--listen", "0.0.0.0:8089"}, "not a loopback address: set --token"},
		{[]string{"console", "--listen", "nohost"}, "--listen"},
		{[]string{"console", "--token", "short"}, "--token: console: bearer token: at least 16 characters"},
		{[]string{"console", "extra"}, "unexpected arguments"},
		{[]string{"console", "--stream", "ORDERS_DLQ", "--nats", ""}, "--stream: needs --nats"},
	} {
		code, _, errs := oncely(t, tc.args...)
		if code != 2 || !strings.Contains(errs, tc.want) {
			t.Errorf("oncely %q: exit %d, stderr %q; want exit 2 mentioning %q", tc.args, code, errs, tc.want)
		}
	}
}

// oncely console serves the pages on the address it prints, only to a
// browser that brought the token, read-only unless --actions, and stops
// when its context ends.
func TestConsoleCommandServes(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	base := []string{"--database-url", db.URL, "--schema", db.Schema}
	if code, out, errs := oncely(t, append([]string{"migrate", "up"}, base...)...); code != 0 {
		t.Fatalf("migrate: %s %s", out, errs)
	}
	const token = "a-token-of-24-characters"
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, append([]string{"console", "--listen", "127.0.0.1:0", "--token", token}, base...), pw, io.Discard)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("no address printed: %v", err)
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	addr := strings.Fields(line)[3]
	if !strings.HasPrefix(addr, "http://127.0.0.1:") || !strings.Contains(line, "read-only") {
		t.Fatalf("printed %q", line)
	}

	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar}
	get := func(u string) (int, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, u, nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get(addr + "outbox"); code != http.StatusUnauthorized {
		t.Errorf("without the token: %d, want 401", code)
	}
	if code, _ := get(addr + "outbox?token=wrong-token-of-24-chars!"); code != http.StatusUnauthorized {
		t.Errorf("with a wrong token: %d, want 401", code)
	}
	// The token once in the URL: a cookie, and a redirect to the page without it.
	code, body := get(addr + "outbox?token=" + token)
	if code != http.StatusOK || !strings.Contains(body, "<h1>Outbox</h1>") || !strings.Contains(body, "read-only") || strings.Contains(body, token) {
		t.Fatalf("with the token: %d %s", code, body)
	}
	if code, _ := get(addr + "inbox"); code != http.StatusOK {
		t.Errorf("with the token's cookie: %d", code)
	}
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, addr+"outbox-retry", strings.NewReader("id=1"))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("an action on a read-only console: %d, want 403", resp.StatusCode)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Errorf("exit %d after the context ended", code)
	}
}
