// Package chaos injects the faults of oncely's soak test: a TCP proxy that
// stalls or cuts the connections through it (put between workers and
// Postgres), and request faults for an in-process kfake cluster (dropped and
// delayed requests).
package chaos

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"
)

// Proxy forwards TCP connections to a target address until it is told to
// stall them (no byte moves either way, the connections stay open) or to
// cut them (both ends closed).
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	links   map[*link]struct{}
	resumed chan struct{} // non-nil while stalled; closed by Resume
	timer   *time.Timer   // ends the current stall
	closed  bool

	wg sync.WaitGroup // the accept loop and every link's pipes
}

// link is one proxied connection.
type link struct {
	client net.Conn
	done   chan struct{} // closed by close

	mu     sync.Mutex
	server net.Conn // nil until dialed
	closed bool
}

// setServer attaches the dialed server side; false (and server closed) if
// the link was closed meanwhile.
func (l *link) setServer(server net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		_ = server.Close()
		return false
	}
	l.server = server
	return true
}

func (l *link) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.closed = true
	close(l.done)
	_ = l.client.Close()
	if l.server != nil {
		_ = l.server.Close()
	}
}

// NewProxy listens on a free port of 127.0.0.1 and forwards every
// connection to target.
func NewProxy(target string) (*Proxy, error) {
	ln, err := new(net.ListenConfig).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, links: make(map[*link]struct{})}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		l := &link{client: c, done: make(chan struct{})}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = c.Close()
			return
		}
		p.links[l] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go p.serve(l)
	}
}

// serve dials the target for l (a stalled proxy does not dial either) and
// pipes bytes both ways until either side closes or l is cut.
func (p *Proxy) serve(l *link) {
	defer p.wg.Done()
	defer func() {
		l.close()
		p.mu.Lock()
		delete(p.links, l)
		p.mu.Unlock()
	}()
	if !p.flowing(l) {
		return
	}
	var d net.Dialer
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	server, err := d.DialContext(ctx, "tcp", p.target)
	cancel()
	if err != nil || !l.setServer(server) {
		return
	}
	var pipes sync.WaitGroup
	pipes.Add(2)
	go func() { defer pipes.Done(); p.pipe(l, server, l.client) }()
	go func() { defer pipes.Done(); p.pipe(l, l.client, server) }()
	pipes.Wait()
}

// pipe copies src to dst, holding each chunk while the proxy is stalled.
// When either side fails, it closes the link, which ends the other pipe.
func (p *Proxy) pipe(l *link, dst, src net.Conn) {
	defer l.close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.flowing(l) {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// flowing waits while the proxy is stalled; false if l was cut meanwhile.
func (p *Proxy) flowing(l *link) bool {
	p.mu.Lock()
	resumed := p.resumed
	p.mu.Unlock()
	if resumed == nil {
		return true
	}
	select {
	case <-resumed:
		return true
	case <-l.done:
		return false
	}
}

// Stall stops every byte through the proxy, on the connections open now
// and on new ones, for d (or until Resume).
func (p *Proxy) Stall(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	if p.resumed == nil {
		p.resumed = make(chan struct{})
	}
	if p.timer != nil {
		p.timer.Stop()
	}
	p.timer = time.AfterFunc(d, p.Resume)
}

// Resume ends a stall at once.
func (p *Proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resume()
}

func (p *Proxy) resume() {
	if p.timer != nil {
		p.timer.Stop()
		p.timer = nil
	}
	if p.resumed != nil {
		close(p.resumed)
		p.resumed = nil
	}
}

// Cut closes every connection through the proxy, both ends, and returns
// how many it closed. New connections are forwarded as before.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	for _, l := range links {
		l.close()
	}
	return len(links)
}

// Close stops accepting, cuts every connection and waits for the proxy's
// goroutines to end.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	p.resume()
	p.mu.Unlock()
	err := p.ln.Close()
	p.Cut()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}
