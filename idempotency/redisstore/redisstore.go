package redisstore

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/idempotency"
)

// Defaults of Config.
const (
	DefaultPrefix  = "oncely:idem:"
	DefaultLockTTL = 30 * time.Second
)

// Config configures a Store. Every field is optional.
type Config struct {
	// Prefix starts every key the store writes, so that several stores
	// (or applications) share one Redis. It must not contain '{' or '}':
	// the store's own hash tag follows it. Default "oncely:idem:".
	Prefix string
	// LockTTL is how long a claim holds a key without a heartbeat: the
	// time after which a process that died mid-request frees its keys.
	// While the handler runs, a heartbeat extends it every Heartbeat.
	// Default 30 seconds, at least 100 ms.
	LockTTL time.Duration
	// Heartbeat is the pause between extensions of a running request's
	// lock. Default LockTTL/3; it must be below LockTTL.
	Heartbeat time.Duration
	// Logger receives heartbeat failures. Default: discard.
	Logger *slog.Logger
}

// Store is the Redis idempotency.Store. Create it with New and pass it to
// idempotency.NewWithStore.
type Store struct {
	rdb       redis.UniversalClient
	cfg       Config
	lockMS    int64
	heartbeat time.Duration
}

// New validates cfg and fills in its defaults. rdb may be a single-node,
// Sentinel (failover) or Cluster client: every command and script touches
// one key. Enable its ContextTimeoutEnabled (see the package
// documentation).
func New(rdb redis.UniversalClient, cfg Config) (*Store, error) {
	if rdb == nil {
		return nil, errors.New("redisstore: rdb is nil")
	}
	if strings.ContainsAny(cfg.Prefix, "{}") {
		return nil, fmt.Errorf("redisstore: Config.Prefix: %q contains '{' or '}', which would change the keys' hash slot", cfg.Prefix)
	}
	cfg.Prefix = cmp.Or(cfg.Prefix, DefaultPrefix)
	if cfg.LockTTL < 0 || (cfg.LockTTL > 0 && cfg.LockTTL < 100*time.Millisecond) {
		return nil, fmt.Errorf("redisstore: Config.LockTTL: %s is below 100ms (0: default %s)", cfg.LockTTL, DefaultLockTTL)
	}
	cfg.LockTTL = cmp.Or(cfg.LockTTL, DefaultLockTTL)
	if cfg.Heartbeat < 0 || cfg.Heartbeat >= cfg.LockTTL {
		return nil, fmt.Errorf("redisstore: Config.Heartbeat: %s is outside (0, Config.LockTTL = %s) (0: default LockTTL/3)", cfg.Heartbeat, cfg.LockTTL)
	}
	cfg.Heartbeat = cmp.Or(cfg.Heartbeat, cfg.LockTTL/3)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	return &Store{rdb: rdb, cfg: cfg, lockMS: cfg.LockTTL.Milliseconds(), heartbeat: cfg.Heartbeat}, nil
}

// Key returns the Redis key of (scope, key): Prefix, then a hash tag of
// the hex SHA-256 of the scope's length, the scope and the key. The one key
// holds the claim's lock while the request runs, then its response.
func (s *Store) Key(scope, key string) string {
	var buf [256]byte // short scopes and keys are hashed from the stack
	b := binary.AppendUvarint(buf[:0], uint64(len(scope)))
	b = append(append(b, scope...), key...)
	sum := sha256.Sum256(b)
	var hexSum [2 * sha256.Size]byte
	hex.Encode(hexSum[:], sum[:])
	var k strings.Builder
	k.Grow(len(s.cfg.Prefix) + len(hexSum) + 2)
	k.WriteString(s.cfg.Prefix)
	k.WriteByte('{')
	k.Write(hexSum[:])
	k.WriteByte('}')
	return k.String()
}

// A key's value is one of two, told apart by its first byte:
//
//	L<token>  the lock of the claim with this fencing token, PX LockTTL
//	R<resp>   the recorded response (encodeResponse), PX the TTL
const (
	tagLock     = 'L'
	tagRecorded = 'R'
)

// The scripts: each reads the key and writes it only while it still holds
// the caller's lock (ARGV[1], "L" and the token) or nothing at all, the
// lock having lapsed with no newer claim in its place. A newer claim's lock
// or a recorded response is never touched: that is the fencing.
var (
	// extend: ARGV lock, lock ms. Re-arms the lock (or takes the key again
	// if the lock lapsed and nothing took its place).
	extendScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
`)
	// record: ARGV lock, "R" and the response, ms to keep it. Replaces the
	// lock by the response.
	recordScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v == ARGV[2] then return 1 end
if v and v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
`)
	// release: ARGV lock. Frees the key if it still holds the lock.
	releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
`)
)

// Claim implements idempotency.Store with one plain command, atomic in
// Redis: SET key L<token> NX PX LockTTL GET. It takes a free key (the reply
// is nil) and returns whatever the key held otherwise, in the same step: a
// recorded response (replay, or 422) or another claim's lock (busy). A
// first request and a replay therefore cost one round trip each to claim.
func (s *Store) Claim(ctx context.Context, scope, key string, fp []byte, ttl time.Duration) (idempotency.Claim, error) {
	k := s.Key(scope, key)
	lock := newLock()
	cmd := redis.NewStringCmd(ctx, "set", k, lock, "nx", "px", s.lockMS, "get")
	_ = s.rdb.Process(ctx, cmd)
	old, err := cmd.Result()
	if err != nil && strings.HasPrefix(err.Error(), "OOM ") {
		// Redis is full (maxmemory, noeviction) and refuses every SET, even
		// one NX would make a no-op; a read still answers a replay or 409.
		if v, gerr := s.rdb.Get(ctx, k).Result(); gerr == nil && v != "" {
			old, err = v, nil
		}
	}
	switch {
	case errors.Is(err, redis.Nil), err == nil && old == lock: // old == lock: a retried SET whose first run took the key
		return idempotency.Claim{State: idempotency.ClaimTaken, Lease: &lease{s: s, key: k, lock: lock, keepUntil: time.Now().Add(ttl)}}, nil
	case err != nil:
		if rerr := redis.Error(nil); !errors.As(err, &rerr) {
			// No reply: the SET may have run. Free the key if it holds
			// this claim's lock, so that the retry the 503 invites is not
			// answered 409 until LockTTL.
			if rerr := s.release(ctx, k, lock, time.Second); rerr != nil {
				s.cfg.Logger.WarnContext(ctx, "oncely redisstore: a claim without a reply could not free its lock; it lapses after LockTTL", "key", k, "err", rerr)
			}
		}
		switch msg := err.Error(); {
		case strings.Contains(msg, "syntax error"):
			err = fmt.Errorf("%w (SET with both NX and GET needs Redis 7.0 or later)", err)
		case strings.HasPrefix(msg, "WRONGTYPE"):
			err = fmt.Errorf("%w (key %s is not this store's: another program, or an earlier layout of this store, uses Config.Prefix %q)", err, k, s.cfg.Prefix)
		}
		return idempotency.Claim{}, fmt.Errorf("redisstore: claim: %w", err)
	case old != "" && old[0] == tagRecorded:
		stored, err := decodeResponse(old[1:])
		if err != nil {
			return idempotency.Claim{}, fmt.Errorf("redisstore: corrupt record %s: %w", k, err)
		}
		return idempotency.Claim{State: idempotency.ClaimStored, Stored: stored}, nil
	case old != "" && old[0] == tagLock:
		return idempotency.Claim{State: idempotency.ClaimBusy}, nil
	}
	return idempotency.Claim{}, fmt.Errorf("redisstore: corrupt record %s: neither a lock nor a response", k)
}

// release deletes key if it still holds lock, within d of a context that
// ctx's cancellation does not end (a release follows a request that may
// have been cancelled).
func (s *Store) release(ctx context.Context, key, lock string, d time.Duration) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d)
	defer cancel()
	return releaseScript.Run(ctx, s.rdb, []string{key}, lock).Err()
}

// newLock returns a fresh lock value: the tag and a random 128-bit fencing
// token, unique to this claim (unguessable is not needed, unique is).
func newLock() string {
	var b [1 + 2*16]byte
	b[0] = tagLock
	var r [16]byte
	binary.LittleEndian.PutUint64(r[:8], rand.Uint64())
	binary.LittleEndian.PutUint64(r[8:], rand.Uint64())
	hex.Encode(b[1:], r[:])
	return string(b[:])
}

// lease is a claimed key: its lock value (with the fencing token), and the
// heartbeat that keeps the lock alive while the handler runs. The heartbeat
// is a timer that re-arms itself, so a request shorter than Heartbeat costs
// no goroutine.
type lease struct {
	s         *Store
	key       string
	lock      string
	keepUntil time.Time // the response's expiry: the TTL from the claim
	finished  bool      // recorded, or refused by the fencing check: nothing to release

	mu      sync.Mutex
	stopped bool
	timer   *time.Timer
	beating sync.WaitGroup  // an extension in flight
	ctx     context.Context // the request's (heartbeats outlive its cancellation)
	cancel  context.CancelCauseFunc
}

// Context starts the heartbeat; the handler's context is cancelled (cause
// idempotency.ErrLeaseLost) once Redis says a newer claim took the key.
func (l *lease) Context(ctx context.Context) context.Context {
	hctx, cancel := context.WithCancelCause(ctx)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ctx, l.cancel = ctx, cancel
	l.timer = time.AfterFunc(l.s.heartbeat, l.beat)
	return hctx
}

// beat extends the lock once and re-arms the timer, unless halted.
func (l *lease) beat() {
	l.mu.Lock()
	if l.stopped {
		l.mu.Unlock()
		return
	}
	l.beating.Add(1)
	l.mu.Unlock()
	defer l.beating.Done()

	ctx := context.WithoutCancel(l.ctx)
	cctx, cancel := context.WithTimeout(ctx, l.s.heartbeat)
	ok, err := extendScript.Run(cctx, l.s.rdb, []string{l.key}, l.lock, l.s.lockMS).Int()
	cancel()
	switch {
	case err != nil:
		// Redis unreachable: keep trying; the lock lapses after
		// LockTTL, and the fencing token then refuses our store if a
		// newer request has claimed the key meanwhile.
		l.s.cfg.Logger.WarnContext(ctx, "oncely redisstore: heartbeat failed", "key", l.key, "err", err)
	case ok == 0:
		l.s.cfg.Logger.WarnContext(ctx, "oncely redisstore: claim lost while the handler runs", "key", l.key)
		l.cancel(idempotency.ErrLeaseLost)
		return
	}
	l.mu.Lock()
	if !l.stopped {
		l.timer.Reset(l.s.heartbeat)
	}
	l.mu.Unlock()
}

// halt stops the heartbeat and waits for an extension in flight, so that
// none runs after the record or the release.
func (l *lease) halt() {
	l.mu.Lock()
	if l.stopped || l.timer == nil {
		l.stopped = true
		l.mu.Unlock()
		return
	}
	l.stopped = true
	l.timer.Stop()
	l.mu.Unlock()
	l.beating.Wait()
	l.cancel(nil)
}

func (l *lease) Failed() bool { return false }

// Record replaces the lock by the response, kept until ttl after the claim
// (at least LockTTL from now), unless a newer claim took the key.
func (l *lease) Record(ctx context.Context, r idempotency.StoredResponse) error {
	l.halt()
	keep := max(time.Until(l.keepUntil), l.s.cfg.LockTTL)
	ok, err := recordScript.Run(ctx, l.s.rdb, []string{l.key}, l.lock, encodeRecord(r), keep.Milliseconds()).Int()
	switch {
	case err != nil:
		return fmt.Errorf("redisstore: record: %w", err)
	case ok == 0:
		l.finished = true
		return idempotency.ErrLeaseLost
	}
	l.finished = true
	return nil
}

// Release frees the key if it still holds this claim's lock. If Redis
// cannot be reached the lock lapses after LockTTL.
func (l *lease) Release(ctx context.Context) {
	l.halt()
	if l.finished {
		return
	}
	if err := l.s.release(ctx, l.key, l.lock, 5*time.Second); err != nil {
		l.s.cfg.Logger.WarnContext(ctx, "oncely redisstore: release failed; the lock lapses after LockTTL", "key", l.key, "err", err)
	}
}

// encodeRecord is the value of a recorded response: its tag, then
// encodeResponse's bytes.
func encodeRecord(r idempotency.StoredResponse) []byte {
	return encodeResponse([]byte{tagRecorded}, r)
}

// encodeResponse appends to b a response packed as one value, so that a
// replay is one read of one key: its status, fingerprint, body, and
// headers' names and values, each a uvarint length and its bytes (any byte
// of a value survives).
// The status comes first, so that decodeResponse refuses a record of
// another layout early.
func encodeResponse(b []byte, r idempotency.StoredResponse) []byte {
	status := strconv.Itoa(r.Status)
	n := fieldLen(len(status)) + fieldLen(len(r.Fingerprint)) + fieldLen(len(r.Body))
	for i := range r.Names {
		n += fieldLen(len(r.Names[i])) + fieldLen(len(r.Values[i]))
	}
	b = slices.Grow(b, n)
	b = appendField(b, status)
	b = appendField(b, string(r.Fingerprint))
	b = appendField(b, string(r.Body))
	for i := range r.Names {
		b = appendField(b, r.Names[i])
		b = appendField(b, r.Values[i])
	}
	return b
}

// fieldLen is the length of a field of n bytes, with its length.
func fieldLen(n int) int {
	var buf [binary.MaxVarintLen64]byte
	return len(binary.AppendUvarint(buf[:0], uint64(n))) + n
}

func appendField(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// fields reads the fields encodeResponse wrote, one at a time.
type fields struct {
	s   string
	off int // of the next field's length
}

// next returns the offsets of the next field's bytes, or ok false at the
// end of s or where the encoding is broken.
func (f *fields) next() (start, end int, ok bool) {
	var n uint64
	for shift, i := uint(0), f.off; i < len(f.s) && shift < 64; shift, i = shift+7, i+1 {
		c := f.s[i]
		if shift == 63 && c > 1 {
			return 0, 0, false // overflows 64 bits
		}
		n |= uint64(c&0x7f) << shift
		if c < 0x80 {
			if uint64(len(f.s)-i-1) < n {
				return 0, 0, false
			}
			start = i + 1
			end = start + int(n)
			f.off = end
			return start, end, true
		}
	}
	return 0, 0, false
}

// decodeResponse reads what encodeResponse wrote. Its fingerprint and body
// share one copy of their bytes; its headers are substrings of s.
func decodeResponse(s string) (idempotency.StoredResponse, error) {
	f := fields{s: s}
	st0, st1, ok1 := f.next()
	fp0, fp1, ok2 := f.next()
	b0, b1, ok3 := f.next()
	if !ok1 || !ok2 || !ok3 {
		return idempotency.StoredResponse{}, errors.New("bad response encoding")
	}
	status, err := strconv.Atoi(s[st0:st1])
	if err != nil || status < 100 || status > 999 {
		return idempotency.StoredResponse{}, errors.New("bad response encoding")
	}
	headers := f.off
	n := 0
	for f.off < len(s) {
		_, _, ok1 := f.next()
		_, _, ok2 := f.next()
		if !ok1 || !ok2 {
			return idempotency.StoredResponse{}, errors.New("bad header encoding")
		}
		n++
	}
	raw := []byte(s[fp0:b1]) // the fingerprint, the body's length, the body
	r := idempotency.StoredResponse{
		Fingerprint: raw[: fp1-fp0 : fp1-fp0],
		Status:      status,
		Body:        raw[b0-fp0 : b1-fp0 : b1-fp0],
	}
	nv := make([]string, 2*n) // the names, then the values
	r.Names, r.Values = nv[:n:n], nv[n:]
	f.off = headers
	for i := range n {
		n0, n1, _ := f.next()
		v0, v1, _ := f.next()
		r.Names[i], r.Values[i] = s[n0:n1], s[v0:v1]
	}
	return r, nil
}
