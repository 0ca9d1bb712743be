package main

import (
	"strings"
	"testing"

	"github.com/oncely/oncely/internal/kafkaflags"
)

// Neither the database password (in DATABASE_URL or --database-url) nor the
// SASL password (in KAFKA_SASL_PASSWORD) shows in -h output or in errors.
// Not parallel: it sets environment variables.
func TestSecretsStayOutOfOutput(t *testing.T) {
	const dbPassword, saslPassword = "db-pw-4c1e9a", "sasl-pw-77b2d0"
	t.Setenv("DATABASE_URL", "postgres://oncely:"+dbPassword+"@127.0.0.1:1/none")
	t.Setenv(kafkaflags.EnvSASLPassword, saslPassword)
	for _, args := range [][]string{
		{"migrate", "up", "-h"},
		{"dlq", "list", "-h"},
		{"outbox", "status", "-h"},
		{"migrate", "up", "--timeout", "1s"},
		{"migrate", "up", "--timeout", "1s", "--database-url", "postgres://oncely:" + dbPassword + "@127.0.0.1:1/none"},
		{"migrate", "up", "--database-url", "postgres://oncely:" + dbPassword + "@[::1"},
		{"dlq", "list", "--brokers", "127.0.0.1:1", "--topic", "t.dlq", "--timeout", "1s", "--sasl-mechanism", "scram-sha-512", "--sasl-user", "u"},
		{"dlq", "list", "--brokers", "127.0.0.1:1", "--topic", "t.dlq", "--sasl-mechanism", "kerberos", "--sasl-user", "u"},
	} {
		_, out, errs := oncely(t, args...)
		if strings.Contains(out+errs, dbPassword) || strings.Contains(out+errs, saslPassword) {
			t.Errorf("oncely %q printed a password: stdout %q, stderr %q", args, out, errs)
		}
	}
}
