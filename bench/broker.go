package main

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

// brokerFlag makes the binary serve a kfake cluster instead of running the
// benchmark: the parent starts itself with it, so that the broker's record
// storage (a 1M-record backlog) lives in another process and the parent's
// RSS is the consumers' own.
const brokerFlag = "-kfake-broker"

// serveBroker runs a one-broker kfake cluster, prints its address on one line
// and serves until its standard input closes (the parent exited).
func serveBroker() error {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		return fmt.Errorf("kfake: %w", err)
	}
	defer c.Close()
	fmt.Println(strings.Join(c.ListenAddrs(), ","))
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// broker is the kfake child process.
type broker struct {
	cmd   *exec.Cmd
	stdin io.Closer
	addrs []string
}

// startBroker starts this binary as a kfake broker and reads its address.
func startBroker(ctx context.Context) (*broker, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, self, brokerFlag)
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
	b := &broker{cmd: cmd, stdin: stdin}
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- strings.TrimSpace(s)
	}()
	select {
	case s := <-line:
		if s == "" {
			b.stop()
			return nil, errors.New("kfake broker exited before printing its address")
		}
		b.addrs = strings.Split(s, ",")
	case <-time.After(30 * time.Second):
		b.stop()
		return nil, errors.New("kfake broker did not print its address within 30s")
	}
	return b, nil
}

// stop closes the broker's standard input and waits for it to exit.
func (b *broker) stop() {
	_ = b.stdin.Close()
	done := make(chan struct{})
	go func() {
		_ = b.cmd.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = b.cmd.Process.Kill()
		<-done
	}
}
