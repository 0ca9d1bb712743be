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
// Sentinel (failover) or Cluster client: every script touches the keys of
// one hash slot only.
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

// Keys returns the two Redis keys of (scope, key): the record (a hash with
// the fencing token, the holder and, once recorded, the response) and the
// lock. Both carry the same hash tag, so they share a Cluster slot.
func (s *Store) Keys(scope, key string) (record, lock string) {
	record = s.record(scope, key)
	return record, record + lockSuffix
}

const lockSuffix = ":lock"

// record returns the record's key: Prefix, then the hash tag, the hex
// SHA-256 of the scope's length, the scope and the key.
func (s *Store) record(scope, key string) string {
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

// The scripts. KEYS[1] is the record hash, KEYS[2] the lock. The record's
// fields: token (the fencing counter, incremented by every claim), holder
// (the token and nonce of the latest claim), and once recorded resp (the
// response: encodeResponse). The record expires TTL after the claim (the
// record script keeps that expiry), or LockTTL after the last heartbeat if
// the handler outlives the TTL.
var (
	// claim: ARGV lock ms, ttl ms, nonce. Returns {2, resp} (stored), {1}
	// (busy) or {3, holder} (claimed). The lock is taken with SET NX
	// before the token is drawn, so a busy key costs no token.
	claimScript = redis.NewScript(`
local r = redis.call('HGET', KEYS[1], 'resp')
if r then return {2, r} end
if not redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[1]) then return {1} end
local holder = redis.call('HINCRBY', KEYS[1], 'token', 1) .. ':' .. ARGV[3]
redis.call('HSET', KEYS[1], 'holder', holder)
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[2]), tonumber(ARGV[1])))
return {3, holder}
`)
	// extend: ARGV holder, lock ms. Re-arms the lock while the holder is
	// still the latest claim and has recorded nothing (the lock is then
	// ours or lapsed, never another's: every claim sets the holder), and
	// keeps the record alive at least as long.
	extendScript = redis.NewScript(`
local h = redis.call('HMGET', KEYS[1], 'holder', 'resp')
if h[1] ~= ARGV[1] or h[2] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
`)
	// record: ARGV holder, resp. Stores the response only for the latest
	// claim (the fencing check), keeping the expiry the claim set, and
	// frees the lock (ours or lapsed, as above).
	recordScript = redis.NewScript(`
local h = redis.call('HMGET', KEYS[1], 'holder', 'resp')
if h[1] ~= ARGV[1] or h[2] then return 0 end
redis.call('HSET', KEYS[1], 'resp', ARGV[2])
redis.call('DEL', KEYS[2])
return 1
`)
	// release: ARGV holder. Frees the lock of an unrecorded claim that is
	// still the latest one.
	releaseScript = redis.NewScript(`
local h = redis.call('HMGET', KEYS[1], 'holder', 'resp')
if h[1] ~= ARGV[1] or h[2] then return 0 end
redis.call('DEL', KEYS[2])
return 1
`)
)

// Claim implements idempotency.Store. A recorded response never changes
// until it expires (the record script stores one only where none is), so a
// plain read answers a replay: one HGET, no script (a script call costs
// Redis several times a read's work). Only a key without a response runs
// the claim script, which checks again, atomically: the response if one was
// recorded meanwhile, else busy if the lock is held, else a new fencing
// token and the lock.
func (s *Store) Claim(ctx context.Context, scope, key string, fp []byte, ttl time.Duration) (idempotency.Claim, error) {
	record := s.record(scope, key)
	switch resp, err := s.rdb.HGet(ctx, record, "resp").Result(); {
	case err == nil:
		return s.stored(record, resp)
	case !errors.Is(err, redis.Nil):
		return idempotency.Claim{}, fmt.Errorf("redisstore: read: %w", err)
	}
	nonce := strconv.FormatUint(rand.Uint64(), 36) // unique, not secret
	keys := []string{record, record + lockSuffix}
	res, err := claimScript.Run(ctx, s.rdb, keys, s.lockMS, ttl.Milliseconds(), nonce).Slice()
	if err != nil {
		return idempotency.Claim{}, fmt.Errorf("redisstore: claim: %w", err)
	}
	state, _ := res[0].(int64)
	switch {
	case state == 1:
		return idempotency.Claim{State: idempotency.ClaimBusy}, nil
	case state == 2 && len(res) == 2:
		resp, _ := res[1].(string)
		return s.stored(record, resp)
	case state == 3 && len(res) == 2:
		holder, _ := res[1].(string)
		return idempotency.Claim{State: idempotency.ClaimTaken, Lease: &lease{s: s, keys: keys, holder: holder}}, nil
	}
	return idempotency.Claim{}, fmt.Errorf("redisstore: claim: unexpected reply %v", res)
}

// stored returns the claim of the recorded response resp.
func (s *Store) stored(record, resp string) (idempotency.Claim, error) {
	stored, err := decodeResponse(resp)
	if err != nil {
		return idempotency.Claim{}, fmt.Errorf("redisstore: corrupt record %s: %w", record, err)
	}
	return idempotency.Claim{State: idempotency.ClaimStored, Stored: stored}, nil
}

// lease is a claimed key: its holder token, and the heartbeat that keeps
// its lock alive while the handler runs. The heartbeat is a timer that
// re-arms itself, so a request shorter than Heartbeat costs no goroutine.
type lease struct {
	s        *Store
	keys     []string
	holder   string
	finished bool // recorded, or refused by the fencing check: nothing to release

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
	ok, err := extendScript.Run(cctx, l.s.rdb, l.keys, l.holder, l.s.lockMS).Int()
	cancel()
	switch {
	case err != nil:
		// Redis unreachable: keep trying; the lock lapses after
		// LockTTL, and the fencing token then refuses our store if a
		// newer request has claimed the key meanwhile.
		l.s.cfg.Logger.WarnContext(ctx, "oncely redisstore: heartbeat failed", "key", l.keys[0], "err", err)
	case ok == 0:
		l.s.cfg.Logger.WarnContext(ctx, "oncely redisstore: claim lost while the handler runs", "key", l.keys[0])
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

func (l *lease) Record(ctx context.Context, r idempotency.StoredResponse) error {
	l.halt()
	ok, err := recordScript.Run(ctx, l.s.rdb, l.keys, l.holder, encodeResponse(r)).Int()
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

// Release frees the lock if the claim is still the latest and unrecorded.
// If Redis cannot be reached the lock lapses after LockTTL.
func (l *lease) Release(ctx context.Context) {
	l.halt()
	if l.finished {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := releaseScript.Run(ctx, l.s.rdb, l.keys, l.holder).Err(); err != nil {
		l.s.cfg.Logger.WarnContext(ctx, "oncely redisstore: release failed; the lock lapses after LockTTL", "key", l.keys[0], "err", err)
	}
}

// encodeResponse packs a response as one value, so that a replay is one
// read of one field: its fingerprint, status, headers' names and values, and
// body, each a uvarint length and its bytes (any byte of a value survives).
// The status comes first, so that decodeResponse refuses a record of
// another layout early.
func encodeResponse(r idempotency.StoredResponse) []byte {
	status := strconv.Itoa(r.Status)
	n := fieldLen(len(status)) + fieldLen(len(r.Fingerprint)) + fieldLen(len(r.Body))
	for i := range r.Names {
		n += fieldLen(len(r.Names[i])) + fieldLen(len(r.Values[i]))
	}
	b := make([]byte, 0, n)
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
