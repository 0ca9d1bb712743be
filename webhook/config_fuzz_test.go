package webhook

import (
	"encoding/base64"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/outbox"
)

// secretMark ends every non-empty secret the fuzzers configure. It is valid
// base64 (so Standard Webhooks secrets can still decode) and appears in no
// message of the package: an error or a log line that contains it quotes a
// secret.
const secretMark = "SeCrEtMaRk4a9Q00"

var verifierMakers = []struct {
	name string
	mk   func(VerifierConfig) (Verifier, error)
}{
	{ProviderStandardWebhooks, NewStandardWebhooks},
	{ProviderStripe, NewStripe},
	{ProviderGitHub, NewGitHub},
}

// verifierConfigValid is the test's own reading of VerifierConfig's rules.
func verifierConfigValid(provider string, cfg VerifierConfig) bool {
	if len(cfg.Secrets) == 0 || cfg.Tolerance < 0 || (provider == ProviderGitHub && cfg.Tolerance != 0) {
		return false
	}
	for _, s := range cfg.Secrets {
		if s == "" {
			return false
		}
		if provider == ProviderStandardWebhooks {
			key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(s, "whsec_"))
			if err != nil || len(key) == 0 {
				return false
			}
		}
	}
	return true
}

// FuzzVerifierConfig: each built-in verifier's constructor accepts exactly
// the valid configs, names the field it refuses, and never quotes a secret;
// nor does Verify, whatever the request carries.
func FuzzVerifierConfig(f *testing.F) {
	f.Add(uint8(0), "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "", int64(0), "v1,abc", "id-1", "1614265330")
	f.Add(uint8(1), "whsec_x", "whsec_y", int64(time.Minute), "t=1,v1=00", "", "")
	f.Add(uint8(2), "s", "", int64(0), "sha256=00", "d-1", "")
	f.Add(uint8(0), "whsec_not*base64", "", int64(-1), "", "", "")
	f.Add(uint8(3), "", "", int64(time.Second), "v1,"+secretMark, secretMark, secretMark)
	f.Fuzz(func(t *testing.T, which uint8, s1, s2 string, tolerance int64, sig, id, ts string) {
		mk := verifierMakers[int(which)%len(verifierMakers)]
		var secrets []string
		for i, s := range []string{s1, s2} {
			if s != "" {
				s += secretMark
			}
			if i < int(which)/len(verifierMakers)%3 {
				secrets = append(secrets, s)
			}
		}
		cfg := VerifierConfig{Secrets: secrets, Tolerance: time.Duration(tolerance)}
		v, err := mk.mk(cfg)
		if valid := verifierConfigValid(mk.name, cfg); (err == nil) != valid {
			t.Fatalf("%s: config %+v: valid %v, but the constructor returned %v", mk.name, cfg, valid, err)
		}
		if err != nil {
			if msg := err.Error(); !strings.Contains(msg, "VerifierConfig.Secrets") && !strings.Contains(msg, "VerifierConfig.Tolerance") {
				t.Fatalf("%s: error %q names no field", mk.name, msg)
			}
			if strings.Contains(err.Error(), secretMark) {
				t.Fatalf("%s: error %q quotes a secret", mk.name, err)
			}
			return
		}
		r := request(map[string]string{
			swSignature: sig, swID: id, swTimestamp: ts,
			stripeSignature: sig, ghSignature: sig, "X-GitHub-Delivery": id,
		})
		// Verify may quote the request's own (truncated) headers: the mark
		// in its error is a secret's only when the request carried none.
		fromRequest := strings.Contains(sig+id+ts, secretMark)
		if _, err := v.Verify(r, []byte(s1+s2), time.Unix(1614265330, 0)); err != nil && strings.Contains(err.Error(), secretMark) && !fromRequest {
			t.Fatalf("%s: Verify error %q quotes a secret", mk.name, err)
		}
	})
}

// receiverErrorFieldRE finds the Config field a Receiver error names.
var receiverErrorFieldRE = regexp.MustCompile(`^webhook: Config\.([A-Za-z]+)[: ]`)

// FuzzReceiverConfig: New never panics, accepts a config exactly when it is
// valid and otherwise names an invalid field.
func FuzzReceiverConfig(f *testing.F) {
	pool := pgtest.UnreachablePool(f)
	v := mustVerifier(f, NewGitHub, VerifierConfig{Secrets: []string{"s"}})
	f.Add("webhooks", "", 0, int64(0), int64(0), 0, true)
	f.Add("web hooks", "oncely", 0, int64(-1), int64(-time.Second), 1, true)
	f.Add("..", `x"; drop table y`, -1, int64(1<<20), int64(time.Second), 1024, false)
	f.Add("a.b_c-d", "pg_x", 1<<16+1, int64(1), int64(1), 1023, true)
	f.Fuzz(func(t *testing.T, topic, schema string, shards int, maxBody, storeTimeout int64, prefixLen int, withPool bool) {
		cfg := Config{Topic: topic, Outbox: outbox.Config{Schema: schema, Shards: shards},
			MaxBodyBytes: maxBody, StoreTimeout: time.Duration(storeTimeout), Verifier: v,
			IDPrefix: strings.Repeat("p", max(0, prefixLen%2048))}
		if withPool {
			cfg.Pool = pool
		}
		_, outboxErr := outbox.New(cfg.Outbox)
		bad := map[string]bool{
			"Pool":         cfg.Pool == nil,
			"Topic":        !topicRE.MatchString(topic) || topic == "." || topic == "..",
			"MaxBodyBytes": maxBody < 0,
			"StoreTimeout": storeTimeout < 0,
			"IDPrefix":     len(cfg.IDPrefix) >= outbox.MaxIDLen,
			"Outbox":       outboxErr != nil,
		}
		rc, err := New(cfg)
		if err == nil && rc == nil {
			t.Fatal("New returned neither a receiver nor an error")
		}
		pgtest.CheckConfigError(t, err, bad, pgtest.FieldMatch(receiverErrorFieldRE))
	})
}
