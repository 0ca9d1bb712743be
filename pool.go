package oncely

import (
	"cmp"
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/internal/sqlident"
)

// DefaultMaxConns is the size of a NewPool pool whose URL sets no
// pool_max_conns: room for a consumer's concurrency next to the relay, the
// cleanups and a few HTTP handlers (pgxpool's own default, four connections
// on a small machine, is too few for a runner: New says so).
const DefaultMaxConns = 16

// NewPool opens a pool for a Runner whose Config.Schema is schema (default
// "oncely"): its connections have schema as their search_path, so that the
// application's own tables live beside oncely's and its SQL need not name
// the schema, and it holds DefaultMaxConns connections unless url sets
// pool_max_conns. A search_path in url must begin with schema (e.g.
// "payments,public", to reach extensions installed in public). The pool
// connects lazily: an unreachable server shows at the first query, and in
// the runner's /readyz.
func NewPool(ctx context.Context, url, schema string) (*pgxpool.Pool, error) {
	schema = cmp.Or(schema, sqlident.DefaultSchema)
	if err := sqlident.ValidateSchema("NewPool schema", schema); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("%w: NewPool url: %w", ErrInvalidConfig, err)
	}
	params := cfg.ConnConfig.RuntimeParams
	if sp, ok := params["search_path"]; ok && strings.TrimSpace(strings.Split(sp, ",")[0]) != schema {
		return nil, invalid("NewPool url", "search_path %q does not begin with the schema %q", sp, schema)
	} else if !ok {
		params["search_path"] = schema
	}
	if !strings.Contains(url, "pool_max_conns") {
		cfg.MaxConns = DefaultMaxConns
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}
