// Package sqlident validates and quotes the SQL identifiers (schema names)
// that oncely's packages accept from configuration.
//
// Identifiers are never taken verbatim from configuration into SQL: they must
// match a conservative allow-list first and are then quoted with
// pgx.Identifier, so a name such as `x"; drop table y` is refused with an error
// instead of reaching the database.
package sqlident

import (
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// DefaultSchema is the schema oncely's tables live in unless configured otherwise.
const DefaultSchema = "oncely"

var schemaRE = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// ValidateSchema reports whether name is an acceptable schema name: lower-case
// ASCII letters, digits and underscores, starting with a letter or underscore,
// at most 63 bytes (Postgres' identifier limit), and not a pg_ system schema.
// field names the configuration field in the error.
func ValidateSchema(field, name string) error {
	if !schemaRE.MatchString(name) {
		return fmt.Errorf("%s: invalid schema name %q: must match %s", field, name, schemaRE)
	}
	if len(name) >= 3 && name[:3] == "pg_" || name == "information_schema" {
		return fmt.Errorf("%s: invalid schema name %q: reserved for the system", field, name)
	}
	return nil
}

// Table returns the quoted, schema-qualified name of table, ready to be
// placed into SQL text. Both parts must already be validated.
func Table(schema, table string) string {
	return pgx.Identifier{schema, table}.Sanitize()
}

// Quote returns the quoted form of a single identifier.
func Quote(name string) string {
	return pgx.Identifier{name}.Sanitize()
}
