package migrations_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/migrations"
)

// Example applies oncely's schema at start-up. Every replica may do this:
// the migrations run under an advisory lock, so one replica applies them and
// the others find nothing left to do.
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

	m, err := migrations.New(pool, migrations.Config{Schema: "oncely"})
	if err != nil {
		log.Print(err) // an invalid schema name is refused here
		return
	}
	applied, err := m.Up(ctx)
	if err != nil {
		log.Print(err)
		return
	}
	for _, mig := range applied {
		fmt.Printf("applied %04d_%s\n", mig.Version, mig.Name)
	}

	status, err := m.Status(ctx)
	if err != nil {
		log.Print(err)
		return
	}
	for _, s := range status {
		fmt.Printf("%04d_%s applied=%v\n", s.Version, s.Name, s.Applied)
	}
}
