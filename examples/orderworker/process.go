package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"sync"
	"syscall"
	"time"
)

// workerProcess is a worker running as a child process, as a deployment runs
// it: the demo and the tests kill it for real (SIGKILL leaves no chance to
// commit offsets or leave the group) or stop it like an orchestrator would
// (SIGTERM, then a deadline).
type workerProcess struct {
	Name   string
	cmd    *exec.Cmd
	out    *lineWriter   // stderr: the worker's log
	stdout *lineWriter   // stdout: spans, with --trace-stdout
	done   chan struct{} // closed once the process has exited and been reaped
}

// startWorkerProcess runs `exe args...` with env added to this process's
// environment, and its stdout and stderr, prefixed with [name], written to
// log. The two are kept apart for find and stdoutLines. (Secrets such as the database URL go in env: command lines are
// visible to every user of the machine.) The process is killed when ctx is
// done, so that no worker outlives the demo or a test.
func startWorkerProcess(ctx context.Context, exe string, args, env []string, name string, log io.Writer) (*workerProcess, error) {
	out := &lineWriter{prefix: "[" + name + "] ", w: log}
	stdout := &lineWriter{prefix: "[" + name + " stdout] ", w: log}
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = stdout, out
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &workerProcess{Name: name, cmd: cmd, out: out, stdout: stdout, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait() // the exit status is read from cmd.ProcessState
		close(p.done)
	}()
	return p, nil
}

// kill sends SIGKILL and waits until the process is gone. It is safe to call
// on a process that already exited.
func (p *workerProcess) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// terminate sends SIGTERM and waits up to timeout for the process to exit,
// returning its exit code. Past the timeout it kills the process and fails.
func (p *workerProcess) terminate(timeout time.Duration) (int, error) {
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return -1, fmt.Errorf("%s: SIGTERM: %w", p.Name, err)
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode(), nil
	case <-t.C:
		p.dumpAndKill()
		return -1, fmt.Errorf("%s did not exit within %s of SIGTERM; killed it (goroutine dump in its log)", p.Name, timeout)
	}
}

// dumpAndKill sends SIGQUIT, on which the Go runtime writes every
// goroutine's stack to stderr (our log) and exits, and then SIGKILL. It is
// for a worker that hangs: the dump shows where.
func (p *workerProcess) dumpAndKill() {
	_ = p.cmd.Process.Signal(syscall.SIGQUIT)
	t := time.NewTimer(2 * time.Second)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
	}
	p.kill()
}

// exited reports whether the process has exited.
func (p *workerProcess) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// find returns the submatches of the first log line matching re.
func (p *workerProcess) find(re *regexp.Regexp) []string { return p.out.find(re) }

// stdoutLines returns the complete lines the process wrote to stdout so far.
func (p *workerProcess) stdoutLines() []string {
	p.stdout.mu.Lock()
	defer p.stdout.mu.Unlock()
	return append([]string(nil), p.stdout.lines...)
}

// lineWriter writes each complete line, prefixed, to w in one Write call, so
// that several processes can share a log, and keeps the lines for find.
type lineWriter struct {
	prefix string
	w      io.Writer

	mu      sync.Mutex
	partial []byte
	lines   []string
}

func (lw *lineWriter) Write(b []byte) (int, error) {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	lw.partial = append(lw.partial, b...)
	for {
		i := bytes.IndexByte(lw.partial, '\n')
		if i < 0 {
			return len(b), nil
		}
		line := string(lw.partial[:i])
		lw.partial = lw.partial[i+1:]
		lw.lines = append(lw.lines, line)
		_, _ = io.WriteString(lw.w, lw.prefix+line+"\n") // a full log is no reason to fail the worker
	}
}

func (lw *lineWriter) find(re *regexp.Regexp) []string {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	for _, l := range lw.lines {
		if m := re.FindStringSubmatch(l); m != nil {
			return m
		}
	}
	return nil
}

// Log lines of the worker that the demo and the tests read.
var (
	httpAddrRE = regexp.MustCompile(`msg="orderworker http listening" addr=(\S+)`)
	stoppedRE  = regexp.MustCompile(`msg="orderworker stopped" processed=(\d+) duplicates=(\d+)`)
)
