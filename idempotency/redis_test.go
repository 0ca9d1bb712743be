package idempotency_test

import (
	"cmp"
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/idempotency/redisstore"
)

// redisAddr is the tests' Redis (REDIS_ADDR, default 127.0.0.1:6379).
func redisAddr() string {
	return cmp.Or(os.Getenv("REDIS_ADDR"), "127.0.0.1:6379")
}

// redisEnv is one test's Redis store, under a key prefix of its own whose
// keys are deleted when the test ends.
type redisEnv struct {
	rdb    *redis.Client
	prefix string
	store  *redisstore.Store
}

func newRedisEnv(t *testing.T) *redisEnv {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr()})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatalf("redis at %s: %v", redisAddr(), err)
	}
	r := &redisEnv{rdb: rdb, prefix: "oncely-test:" + uuid.NewString() + ":"}
	var err error
	r.store, err = redisstore.New(rdb, redisstore.Config{Prefix: r.prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if keys, err := r.keys(ctx); err == nil && len(keys) > 0 {
			_ = rdb.Del(ctx, keys...).Err()
		}
		_ = rdb.Close()
	})
	return r
}

func (r *redisEnv) keys(ctx context.Context) ([]string, error) {
	var all []string
	iter := r.rdb.Scan(ctx, 0, r.prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		all = append(all, iter.Val())
	}
	return all, iter.Err()
}

// storedKeys counts the recorded responses and the held locks: every key
// the store holds is one or the other.
func (r *redisEnv) storedKeys(t *testing.T) int {
	t.Helper()
	keys, err := r.keys(context.Background())
	if err != nil {
		t.Fatalf("redis scan: %v", err)
	}
	return len(keys)
}

// stored reports a response recorded for (scope, key).
func (r *redisEnv) stored(t *testing.T, scope, key string) bool {
	t.Helper()
	k := r.store.Key(scope, key)
	v, err := r.rdb.Get(context.Background(), k).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		t.Fatalf("redis get %s: %v", k, err)
	}
	return strings.HasPrefix(v, "R")
}
