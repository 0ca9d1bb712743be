package idempotency

import (
	"context"
	"errors"
	"time"
)

// Store keeps the keys of a Middleware: who holds a key right now, and the
// response recorded for it. [New] uses the Postgres store, which commits the
// response with the handler's writes; [NewWithStore] takes another one, such
// as the Redis store of package idempotency/redisstore.
//
// A Store's methods are called concurrently.
type Store interface {
	// Claim tries to take the key (scope, key) for a request whose
	// fingerprint is fp. The key stays taken until the returned Lease
	// records a response or is released; a recorded response is kept for
	// ttl, counted from the claim. Claim never waits for another holder:
	// a key held right now is ClaimBusy. An error means the store could not
	// be reached or failed; the middleware answers 503 and nothing ran.
	Claim(ctx context.Context, scope, key string, fp []byte, ttl time.Duration) (Claim, error)
}

// ClaimState is the outcome of Store.Claim.
type ClaimState int

const (
	// ClaimBusy: another request holds the key right now (409).
	ClaimBusy ClaimState = iota + 1
	// ClaimStored: a response is recorded for the key; Claim.Stored holds
	// it (replay, or 422 when its fingerprint differs).
	ClaimStored
	// ClaimTaken: the key is this request's; Claim.Lease records its
	// response or releases it.
	ClaimTaken
)

// Claim is the result of Store.Claim.
type Claim struct {
	State  ClaimState
	Stored StoredResponse // when State is ClaimStored
	Lease  Lease          // when State is ClaimTaken
}

// StoredResponse is a recorded response: the fingerprint of the request
// that produced it, its status, its recorded headers as (name, value) pairs
// in order, and its body byte for byte.
type StoredResponse struct {
	Fingerprint   []byte
	Status        int
	Names, Values []string
	Body          []byte
}

// Lease is a claimed key, held until Record or Release. The middleware calls
// Context before the handler runs, then exactly one of Record or Release
// (Release may follow a failed Record, and must then be harmless).
type Lease interface {
	// Context returns the handler's context: ctx with whatever the store
	// lends the handler (the Postgres store's transaction, see [Tx]), and
	// which the store may cancel when it knows the key is no longer this
	// request's.
	Context(ctx context.Context) context.Context
	// Failed reports that the handler's work cannot be committed (the
	// Postgres store: a statement of the transaction failed), so the
	// response must not be recorded.
	Failed() bool
	// Record stores resp (and commits the handler's writes, if the store
	// holds them) and frees the key for replays. ErrLeaseLost means the
	// key was taken over by a newer request and nothing was stored; any
	// other error means the outcome is unknown or nothing was stored.
	Record(ctx context.Context, resp StoredResponse) error
	// Release frees the key without recording anything (and rolls the
	// handler's writes back, if the store holds them).
	Release(ctx context.Context)
}

// ErrLeaseLost is returned by Lease.Record when the key's claim expired and
// a newer request claimed the key: the response was not stored, so it cannot
// overwrite the newer request's. The middleware answers 409, and the
// client's retry gets the newer request's response.
var ErrLeaseLost = errors.New("idempotency: the key's claim expired and a newer request took the key over")
