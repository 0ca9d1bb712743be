package rabbitconsumer

import (
	"fmt"
	"slices"
	"testing"
)

// acks records the basic.acks sent.
type acks []string

func (a *acks) Ack(tag uint64, multiple bool) error {
	*a = append(*a, fmt.Sprintf("%d/%t", tag, multiple))
	return nil
}

// A tracked acker acknowledges a batch with one multiple ack only when no
// other delivery below its highest tag is unacknowledged; otherwise, and
// untracked, one ack per delivery.
func TestAckerMultipleOnlyForTheOldestBatch(t *testing.T) {
	var sent acks
	a := &acker{ch: &sent, tracked: true}
	for tag := uint64(1); tag <= 9; tag++ {
		a.delivered(tag)
	}
	steps := []struct {
		tags []uint64
		want []string
	}{
		{[]uint64{4, 5, 6}, []string{"4/false", "5/false", "6/false"}}, // 1 to 3 still running: not multiple
		{[]uint64{1, 2, 3}, []string{"3/true"}},                        // the oldest: one multiple ack
		{[]uint64{8}, []string{"8/false"}},
		{[]uint64{7, 9}, []string{"9/true"}}, // 8 acknowledged already: 7 and 9 are all that is left below 9
	}
	for _, st := range steps {
		sent = nil
		if err := a.ack(st.tags...); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(sent, st.want) {
			t.Errorf("ack %v: sent %v, want %v", st.tags, sent, st.want)
		}
	}
	if len(a.unacked) != 0 {
		t.Errorf("unacknowledged after all were acknowledged: %v", a.unacked)
	}
	sent = nil
	a.delivered(10)
	a.delivered(11)
	a.delivered(12)
	if err := a.ack(10, 11); err != nil || !slices.Equal(sent, []string{"11/true"}) {
		t.Errorf("ack 10 and 11 with 12 running: sent %v (%v), want one multiple ack of 11", sent, err)
	}

	var each acks
	u := &acker{ch: &each}
	u.delivered(1)
	u.delivered(2)
	if err := u.ack(1, 2); err != nil || !slices.Equal(each, []string{"1/false", "2/false"}) {
		t.Errorf("untracked: sent %v (%v), want one ack each", each, err)
	}
}
