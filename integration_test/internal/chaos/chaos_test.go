package chaos_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/oncely/oncely/integration_test/internal/chaos"
)

// echoServer echoes every connection's bytes back until the test ends.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := new(net.ListenConfig).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().String()
}

// dial connects to addr; the connection is closed when the test ends.
func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := new(net.Dialer).DialContext(t.Context(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func roundTrip(t *testing.T, c net.Conn, msg string, within time.Duration) error {
	t.Helper()
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(within))
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		t.Fatalf("read %q; want %q", buf, msg)
	}
	return nil
}

func TestProxyStallAndCut(t *testing.T) {
	p, err := chaos.NewProxy(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c := dial(t, p.Addr())
	if err := roundTrip(t, c, "before", 5*time.Second); err != nil {
		t.Fatalf("through the proxy: %v", err)
	}

	// Stalled: nothing comes back, and the connection stays open.
	p.Stall(time.Hour)
	if err := roundTrip(t, c, "stalled", 300*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("through a stalled proxy: %v; want a read timeout", err)
	}
	p.Resume()
	buf := make([]byte, len("stalled"))
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "stalled" {
		t.Fatalf("after Resume: read %q, %v; want the stalled bytes", buf, err)
	}

	// Cut: the connection is closed; a new one works.
	if n := p.Cut(); n != 1 {
		t.Errorf("Cut closed %d connections; want 1", n)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(buf); !errors.Is(err, io.EOF) {
		t.Errorf("read after Cut: %v; want EOF", err)
	}
	if err := roundTrip(t, dial(t, p.Addr()), "after", 5*time.Second); err != nil {
		t.Fatalf("a new connection after Cut: %v", err)
	}
}

func TestKafkaFaults(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.ProducerLinger(0))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	created, err := kadm.NewClient(cl).CreateTopics(ctx, 1, 1, nil, "faulty", "other")
	if err == nil {
		err = created.Error()
	}
	if err != nil {
		t.Fatal(err)
	}
	f := chaos.NewKafkaFaults(c, []kmsg.Key{kmsg.Produce}, map[string][16]byte{"faulty": created["faulty"].ID})
	produce := func(topic string) time.Duration {
		t.Helper()
		start := time.Now()
		if err := cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: []byte("v")}).FirstErr(); err != nil {
			t.Fatalf("produce to %s: %v", topic, err)
		}
		return time.Since(start)
	}
	produce("other") // metadata and producer id first

	// A drop armed for the faulty topic spares the other one...
	f.Drop(kmsg.Produce, 1)
	produce("other")
	if n := f.Dropped(kmsg.Produce); n != 0 {
		t.Errorf("%d produce requests to another topic dropped; want 0", n)
	}
	// ...and meets the next produce to the faulty topic, which the client
	// retries.
	produce("faulty")
	if n := f.Dropped(kmsg.Produce); n != 1 {
		t.Errorf("%d produce requests dropped; want 1", n)
	}
	f.Delay(kmsg.Produce, 400*time.Millisecond)
	if d := produce("other"); d < 400*time.Millisecond {
		t.Errorf("a delayed produce took %s; want at least 400ms", d)
	}
	if n := f.Delayed(kmsg.Produce); n != 1 {
		t.Errorf("%d produce requests delayed; want 1", n)
	}
	f.Drop(kmsg.Produce, 5)
	f.Off()
	produce("faulty")
	if n := f.Dropped(kmsg.Produce); n != 1 {
		t.Errorf("%d produce requests dropped after Off; want still 1", n)
	}
}
