// Package kfakechild runs a kfake cluster in a child process of the
// benchmark: the binary starts itself with Arg, so that the broker's record
// storage and CPU are another process's, measured apart from the
// consumers'.
package kfakechild

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

// Arg, as the binary's only argument, makes it Serve instead of running.
const Arg = "-kfake-broker"

// Serve runs a one-broker kfake cluster with opts, prints its address on one
// line and serves until its standard input closes (the parent exited).
func Serve(opts ...kfake.Opt) error {
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)...)
	if err != nil {
		return fmt.Errorf("kfake: %w", err)
	}
	defer c.Close()
	fmt.Println(strings.Join(c.ListenAddrs(), ","))
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// Broker is the kfake child process.
type Broker struct {
	Cmd   *exec.Cmd
	Addrs []string
	stdin io.Closer
}

// Start starts this binary with Arg and reads the broker's address.
func Start(ctx context.Context) (*Broker, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, self, Arg)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start kfake broker: %w", err)
	}
	b := &Broker{Cmd: cmd, stdin: stdin}
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- strings.TrimSpace(s)
	}()
	select {
	case s := <-line:
		if s == "" {
			b.Stop()
			return nil, errors.New("kfake broker exited before printing its address")
		}
		b.Addrs = strings.Split(s, ",")
	case <-time.After(30 * time.Second):
		b.Stop()
		return nil, errors.New("kfake broker did not print its address within 30s")
	}
	return b, nil
}

// Stop closes the broker's standard input and waits for it to exit.
func (b *Broker) Stop() {
	_ = b.stdin.Close()
	done := make(chan struct{})
	go func() {
		_ = b.Cmd.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = b.Cmd.Process.Kill()
		<-done
	}
}
