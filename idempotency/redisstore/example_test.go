package redisstore_test

import (
	"encoding/json"
	"log"
	"net/http"

	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/idempotency/redisstore"
	"github.com/oncely/oncely/webhook"
)

// chargeProvider stands for a payment provider's client that deduplicates
// by an idempotency key of its own (as Stripe's API does).
type chargeProvider interface {
	Charge(idempotencyKey string, cents int64) (chargeID string, err error)
}

// Example serves POST /charges with a required Idempotency-Key held in
// Redis. The effect is a call to a payment provider, so nothing can commit
// it together with the stored response: the handler passes the request's
// key on to the provider, which deduplicates a second call should the
// response not get stored (a crash, Redis unreachable at the end).
//
// (No Output line: the example needs Redis and a provider.)
func Example() {
	var provider chargeProvider // your provider's client
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", ContextTimeoutEnabled: true})
	store, err := redisstore.New(rdb, redisstore.Config{})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idempotency.NewWithStore(store, idempotency.Config{})
	if err != nil {
		log.Fatal(err)
	}
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Cents int64 }
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, "bad body", http.StatusBadRequest) // recorded: a retry gets the same 400
			return
		}
		scope, key, _ := idempotency.Key(r.Context())
		id, err := provider.Charge(scope+":"+key, req.Cents)
		if err != nil {
			http.Error(w, "provider unavailable", http.StatusBadGateway) // not recorded: a retry runs again
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]string{"charge": id})
	})
	auth := func(next http.Handler) http.Handler { // your authentication
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			next.ServeHTTP(w, r.WithContext(idempotency.WithClient(r.Context(), r.Header.Get("X-Account"))))
		})
	}
	http.Handle("POST /charges", auth(mw.Require(charge)))
	log.Fatal(http.ListenAndServe(":8080", nil))
}

// Example_webhookIntake receives Standard Webhooks deliveries and processes
// each once, with Redis and without Postgres: a webhook.Intake verifies each
// request, then runs it through the middleware with the delivery id as its
// key. A redelivery gets the first answer below 500 replayed; one that
// races the first gets 409 and the provider retries it. The processing
// should pass the delivery id on to whatever it calls (see the package
// documentation's windows).
func Example_webhookIntake() {
	verifier, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{Secrets: []string{"whsec_c2VjcmV0"}})
	if err != nil {
		log.Fatal(err)
	}
	store, err := redisstore.New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", ContextTimeoutEnabled: true}), redisstore.Config{})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idempotency.NewWithStore(store, idempotency.Config{})
	if err != nil {
		log.Fatal(err)
	}
	intake, err := webhook.NewIntake(webhook.IntakeConfig{
		Verifier: verifier, Idempotency: mw,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, deliveryID, _ := idempotency.Key(r.Context())
			_ = deliveryID // pass it on as the idempotency key of the calls this delivery makes
			w.WriteHeader(http.StatusNoContent)
		}),
	})
	if err != nil {
		log.Fatal(err)
	}
	http.Handle("POST /webhooks", intake)
	log.Fatal(http.ListenAndServe(":8080", nil))
}
