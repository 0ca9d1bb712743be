package oncely_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/internal/pgtest"
)

func withParam(url, param string) string {
	if strings.Contains(url, "?") {
		return url + "&" + param
	}
	return url + "?" + param
}

// TestNewPool: the pool's tables land in the schema, it is sized for a
// runner unless the URL says otherwise, and a search_path elsewhere or an
// invalid schema is a configuration error.
func TestNewPool(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := t.Context()

	pool, err := oncely.NewPool(ctx, db.URL, db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if got := pool.Config().MaxConns; got != oncely.DefaultMaxConns {
		t.Errorf("MaxConns = %d, want %d", got, oncely.DefaultMaxConns)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE app_rows (id int)"); err != nil {
		t.Fatal(err)
	}
	var found bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", db.Schema+".app_rows").Scan(&found); err != nil || !found {
		t.Errorf("an unqualified CREATE TABLE did not land in schema %s (found %v, err %v)", db.Schema, found, err)
	}

	sized, err := oncely.NewPool(ctx, withParam(db.URL, "pool_max_conns=5"), db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	defer sized.Close()
	if got := sized.Config().MaxConns; got != 5 {
		t.Errorf("MaxConns with pool_max_conns=5 = %d", got)
	}

	withPublic, err := oncely.NewPool(ctx, withParam(db.URL, "search_path="+db.Schema+",public"), db.Schema)
	if err != nil {
		t.Fatalf("a search_path that begins with the schema: %v", err)
	}
	defer withPublic.Close()
	var path string
	if err := withPublic.QueryRow(ctx, "SHOW search_path").Scan(&path); err != nil || !strings.HasPrefix(path, db.Schema) {
		t.Errorf("search_path = %q (err %v), want the URL's, beginning with %s", path, err, db.Schema)
	}

	for name, c := range map[string]struct{ url, schema, want string }{
		"search_path elsewhere": {withParam(db.URL, "search_path=public"), db.Schema, `search_path "public"`},
		"invalid schema":        {db.URL, "Payments-1", "NewPool schema"},
		"invalid url":           {"postgres://[::1", db.Schema, "NewPool url"},
	} {
		p, err := oncely.NewPool(ctx, c.url, c.schema)
		if err == nil {
			p.Close()
			t.Errorf("%s: no error", name)
			continue
		}
		if !errors.Is(err, oncely.ErrInvalidConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want ErrInvalidConfig naming %q", name, err, c.want)
		}
	}
}
