package main

import (
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// clockTick is the unit of utime and stime in /proc/<pid>/stat (USER_HZ,
// 100 on Linux for every architecture Go runs on).
const clockTick = 10 * time.Millisecond

// procCPU returns the user and system CPU time a process has used, or 0 if
// it cannot be read (the process is gone, or not on this machine).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// The command name, in parentheses, may hold spaces: fields count from
	// after it. utime and stime are fields 14 and 15 of the whole line.
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * clockTick
}

// selfCPU returns the CPU time this process has used.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// backends tracks the server processes of a mode's pool, so that the
// Postgres CPU a mode costs can be told from the rest of the server's load.
type backends struct {
	mu   sync.Mutex
	pids []int
}

func (b *backends) add(pid uint32) {
	b.mu.Lock()
	b.pids = append(b.pids, int(pid))
	b.mu.Unlock()
}

func (b *backends) cpu() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	var sum time.Duration
	for _, pid := range b.pids {
		sum += procCPU(pid)
	}
	return sum
}

// cpuUse is the CPU time spent in a measured window: by the benchmark
// process and its kfake broker (app), and by the mode's Postgres backends
// (pg). Postgres's background writers are not counted.
type cpuUse struct{ app, pg time.Duration }

// cpuMeter reads the counters that make up a cpuUse.
type cpuMeter struct {
	brokerPID int
	db        *db
}

func (m cpuMeter) read() cpuUse {
	return cpuUse{app: selfCPU() + procCPU(m.brokerPID), pg: m.db.backends.cpu()}
}

func (u cpuUse) since(start cpuUse) cpuUse {
	return cpuUse{app: u.app - start.app, pg: u.pg - start.pg}
}

// startCPUProfile writes a CPU profile to path until stop is called; with
// no path it does nothing.
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}, nil
}
