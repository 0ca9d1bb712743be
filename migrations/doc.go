// Package migrations holds oncely's versioned SQL schema and a migrator that
// applies it.
//
// The SQL lives in embedded files named NNNN_name.up.sql and NNNN_name.down.sql
// (see [FS]). The files use unqualified table names; the migrator runs each one
// with search_path set to the configured schema (default "oncely"), so the same
// files can be applied by goose, atlas or psql:
//
//	psql -c 'CREATE SCHEMA IF NOT EXISTS oncely'
//	PGOPTIONS='-c search_path=oncely' psql -f migrations/sql/0001_inbox.up.sql
//
// # Guarantees
//
//   - Every Up, Down and Status call runs in one transaction that first takes
//     pg_advisory_xact_lock on a key derived from the schema name. Replicas that
//     start together serialize on that lock: one applies the pending
//     migrations, the others wait, then find nothing left to do.
//   - Applied versions are recorded in <schema>.oncely_migrations in the same
//     transaction as the DDL, so a migration is either applied and recorded or
//     neither. Running Up twice is a no-op.
//   - The schema name is checked against an allow-list
//     (^[a-z_][a-z0-9_]{0,62}$, no pg_ prefix) and quoted with pgx.Identifier.
//
// # Not guaranteed
//
// The lock covers oncely's migrator only. Applying the files with another tool
// at the same time as the migrator is not coordinated: use one or the other.
package migrations
