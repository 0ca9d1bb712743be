package idempotency_test

import (
	"context"
	"io"
	"log"
	"net/http"
	"os"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/migrations"
)

// accounts maps API keys to the accounts they authenticate.
var accounts = map[string]string{"Bearer key-of-acme": "acme", "Bearer key-of-globex": "globex"}

// Example serves POST /orders with a required Idempotency-Key. The order
// row and the recorded response commit in one transaction, so a client that
// retries (after a timeout, a dropped connection, a crash of this server)
// creates the order once and gets the same 201 back every time.
//
// (No Output line: the example needs a database, so `go test` compiles it
// but does not run it; the tests above exercise the same calls.)
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Print(err)
		return
	}
	defer pool.Close()
	m, err := migrations.New(pool, migrations.Config{}) // creates oncely.idempotency_keys
	if err != nil {
		log.Print(err)
		return
	}
	if _, err := m.Up(ctx); err != nil {
		log.Print(err)
		return
	}

	// Keys are per client: two clients may pick the same key. By default
	// the client is the one the request's context names, which the
	// authentication middleware below sets (or set Config.Scope).
	mw, err := idempotency.New(pool, idempotency.Config{})
	if err != nil {
		log.Print(err) // an invalid config is refused here, naming the field
		return
	}
	go func() { _ = mw.Run(ctx) }() // deletes expired keys in batches

	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idempotency.Tx(r.Context()) // always present behind Require
		body, err := io.ReadAll(r.Body)      // the raw body, already read once by the middleware
		if err != nil {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		var id int64
		if err := tx.QueryRow(r.Context(), "INSERT INTO shop.orders (doc) VALUES ($1) RETURNING id", body).Scan(&id); err != nil {
			// A 5xx is not recorded: the transaction rolls back and a
			// retry runs this handler again.
			http.Error(w, "could not store the order", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/"+strconv.FormatInt(id, 10))
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":`+strconv.FormatInt(id, 10)+`}`)
	})))
	// authenticate names the verified client of every request; the
	// middleware refuses a keyed request that names none (401).
	authenticate := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			account, ok := accounts[r.Header.Get("Authorization")]
			if !ok {
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r.WithContext(idempotency.WithClient(r.Context(), account)))
		})
	}
	log.Print(http.ListenAndServe(":8080", authenticate(mux)))
	return
}
