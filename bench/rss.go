package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"
)

// rssReport summarises the process's resident set size while a backlog
// drained.
type rssReport struct {
	samples     int
	firstQ      uint64 // mean RSS over the first quarter of the samples, bytes
	lastQ       uint64 // mean RSS over the last quarter
	peak        uint64 // the largest sample
	hwm         uint64 // the kernel's peak (VmHWM) since the sampling began
	maxHeapLive uint64 // the largest Go heap in use seen
}

// growth is the last quarter's mean RSS over the first quarter's.
func (r *rssReport) growth() float64 {
	if r.firstQ == 0 {
		return 0
	}
	return float64(r.lastQ) / float64(r.firstQ)
}

// sampleRSS returns a sampler for kafkaMode.sample: it returns memory that
// earlier modes left behind to the OS, resets the kernel's peak RSS, then
// reads VmRSS every interval until the returned function is called.
func sampleRSS(interval time.Duration) func(ctx context.Context) func() *rssReport {
	return func(ctx context.Context) func() *rssReport {
		runtime.GC()
		debug.FreeOSMemory()
		// "5" resets VmHWM to the current RSS (Linux 4.0 and later).
		_ = os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
		var (
			mu      sync.Mutex
			samples []uint64
			heap    uint64
		)
		ctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			t := time.NewTicker(interval)
			defer t.Stop()
			var ms runtime.MemStats
			for {
				rss, _ := procStatus("VmRSS")
				runtime.ReadMemStats(&ms)
				mu.Lock()
				samples = append(samples, rss)
				heap = max(heap, ms.HeapInuse)
				mu.Unlock()
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		}()
		return func() *rssReport {
			cancel()
			<-done
			r := &rssReport{samples: len(samples), maxHeapLive: heap}
			r.hwm, _ = procStatus("VmHWM")
			q := max(len(samples)/4, 1)
			r.firstQ, r.lastQ = mean(samples[:q]), mean(samples[len(samples)-q:])
			for _, s := range samples {
				r.peak = max(r.peak, s)
			}
			return r
		}
	}
}

// rssNote is the RSS mode's note in the table.
func rssNote(r *rssReport) string {
	return fmt.Sprintf("RSS %s first quarter, %s last (x%.2f), peak %s, Go heap peak %s",
		mib(r.firstQ), mib(r.lastQ), r.growth(), mib(max(r.peak, r.hwm)), mib(r.maxHeapLive))
}

func mean(s []uint64) uint64 {
	var sum uint64
	for _, v := range s {
		sum += v
	}
	return sum / uint64(max(len(s), 1))
}

// procStatus reads a "kB" field of /proc/self/status, in bytes.
func procStatus(field string) (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || name != field {
			continue
		}
		kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		return kb * 1024, err
	}
	return 0, sc.Err()
}
