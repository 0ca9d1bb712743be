// Package runenv holds what the benchmark's commands share about the place
// a run happens: the machine's load, and a consumer group settling before a
// run is timed.
package runenv

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// LoadAverage is the machine's 1, 5 and 15 minute load average: other work
// on the machine moves the absolute figures.
func LoadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

// WaitStable waits up to timeout until group is stable with members members
// and all partitions of topic assigned, so that a run measures the group's
// work and not its first start-up.
func WaitStable(ctx context.Context, brokers []string, group, topic string, members, partitions int, timeout time.Duration) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	last := "not described"
	for {
		gs, err := adm.DescribeGroups(ctx, group)
		if err == nil {
			g := gs[group]
			last = fmt.Sprintf("state %s, %d members", g.State, len(g.Members))
			if g.State == "Stable" && len(g.Members) == members && len(g.AssignedPartitions()[topic]) == partitions {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("group %s not stable with %d members within %s (%s)", group, members, timeout, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
