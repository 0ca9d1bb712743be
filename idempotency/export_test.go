package idempotency

import "net/http"

// SetAfterCommitHook arms the crash point between the commit and the
// response: when f returns an error the middleware aborts the connection
// without a response, as if the process died right after committing.
func SetAfterCommitHook(m *Middleware, f func(r *http.Request) error) { m.hooks.afterCommit = f }
