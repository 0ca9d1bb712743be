package sqlident_test

import (
	"strings"
	"testing"

	"github.com/oncely/oncely/internal/sqlident"
)

func TestValidateSchemaAccepts(t *testing.T) {
	t.Parallel()
	for _, name := range []string{
		sqlident.DefaultSchema,
		"a",
		"_",
		"_private",
		"public",
		"oncely_2",
		"t_0123456789ab",
		"pgx", // "pg" not followed by an underscore is not reserved
		"pgfoo",
		strings.Repeat("a", 63), // Postgres' identifier limit (NAMEDATALEN-1)
	} {
		if err := sqlident.ValidateSchema("Config.Schema", name); err != nil {
			t.Errorf("ValidateSchema(%q) = %v, want nil", name, err)
		}
	}
}

func TestValidateSchemaRefuses(t *testing.T) {
	t.Parallel()
	for _, name := range []string{
		"",
		`x"; drop table y`,
		`x"y`,
		"Upper",
		"oncelY",
		"1abc",
		"with space",
		"with-dash",
		"with.dot",
		"ünïcode",
		"tab\t",
		"new\nline",
		strings.Repeat("a", 64), // would be silently truncated by Postgres
		"pg_catalog",
		"information_schema",
		"pg_toast",
		"pg_temp_1",
		"pg_",
	} {
		err := sqlident.ValidateSchema("Config.Schema", name)
		if err == nil {
			t.Errorf("ValidateSchema(%q) = nil, want an error", name)
			continue
		}
		if !strings.Contains(err.Error(), "Config.Schema") {
			t.Errorf("ValidateSchema(%q) error %q does not name the field Config.Schema", name, err)
		}
	}
}

func TestTableAndQuote(t *testing.T) {
	t.Parallel()
	if got, want := sqlident.Table("oncely", "inbox"), `"oncely"."inbox"`; got != want {
		t.Errorf("Table = %s, want %s", got, want)
	}
	if got, want := sqlident.Quote("oncely"), `"oncely"`; got != want {
		t.Errorf("Quote = %s, want %s", got, want)
	}
	// Quoting alone must neutralise a double quote, although ValidateSchema
	// refuses such names before they get here.
	if got, want := sqlident.Quote(`x"; drop table y`), `"x""; drop table y"`; got != want {
		t.Errorf("Quote = %s, want %s", got, want)
	}
}
