// Command oncely is the operator CLI: schema migrations, dead-letter
// inspection and redrive, the outbox backlog and its parked rows, and
// outbound webhook deliveries.
//
//	oncely migrate up|down|status   [--database-url URL] [--schema oncely] [--to N]
//	oncely dlq list    --topic T [filters] [--skip-invalid]
//	oncely dlq show    --topic T REF...
//	oncely dlq redrive --topic T [filters] [--ref P/O]... [--to-topic X] [--dry-run] --database-url URL [--schema oncely]
//	oncely outbox status [--database-url URL] [--schema oncely]
//	oncely outbox parked [--limit N]
//	oncely outbox retry ID...|--all
//	oncely outbox discard ID...
//	oncely inbox count [--group G]
//	oncely inbox get MESSAGE-ID [--group G]
//	oncely inbox retention --retention D [--group G]
//	oncely webhooks redrive (--subscription ID | --all-subscriptions) [--since T] [--until T] [--dry-run]
//	oncely webhooks status|pause|resume ...
//	oncely console [--listen 127.0.0.1:8089] [--token T] [--actions] [--dlq-topic T]... [--inbox-retention D] [--sample-interval D]
//
// Every command takes --json: it then prints JSON Lines (one object per
// row, or a single object for a summary) whose keys are snake_case.
// Subscription URLs are shown without their credentials.
//
// Kafka commands take --brokers (or KAFKA_BROKERS), TLS (--tls, --tls-ca,
// --tls-cert, --tls-key, --tls-insecure-skip-verify) and SASL
// (--sasl-mechanism, --sasl-user, --sasl-password, or KAFKA_SASL_MECHANISM,
// KAFKA_SASL_USER, KAFKA_SASL_PASSWORD) flags, shared with the orderworker
// example. Passwords from the environment are read after parsing, so -h
// never prints them. Exit status: 0 ok, 1 failure, 2 bad usage.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// errUsage marks errors in how the command was called (exit status 2).
var errUsage = errors.New("usage")

func usageErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, args...))
}

const usage = `usage:
  oncely migrate up|down|status [flags]
  oncely dlq list|show|redrive [flags]
  oncely outbox status|parked|retry|discard [flags]
  oncely inbox count|get|retention [flags]
  oncely webhooks redrive|status|pause|resume [flags]
  oncely console [flags]
Run "oncely <command> <subcommand> -h" for the flags.
`

// run executes one command line and returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	err := dispatch(ctx, args, stdout, stderr)
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		fmt.Fprintf(stderr, "oncely: %v\n", err)
		return 2
	default:
		fmt.Fprintf(stderr, "oncely: %v\n", err)
		return 1
	}
}

func dispatch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "console" {
		return consoleCmd(ctx, args[1:], stdout, stderr)
	}
	if len(args) < 2 {
		fmt.Fprint(stderr, usage)
		return usageErr("missing command")
	}
	cmd, sub, rest := args[0], args[1], args[2:]
	switch cmd {
	case "migrate":
		return migrateCmd(ctx, sub, rest, stdout, stderr)
	case "dlq":
		return dlqCmd(ctx, sub, rest, stdout, stderr)
	case "outbox":
		return outboxCmd(ctx, sub, rest, stdout, stderr)
	case "inbox":
		return inboxCmd(ctx, sub, rest, stdout, stderr)
	case "webhooks":
		return webhooksCmd(ctx, sub, rest, stdout, stderr)
	}
	fmt.Fprint(stderr, usage)
	return usageErr("unknown command %q", cmd)
}

// parseArgs parses flags placed before, between and after the positional
// arguments, and returns the positional arguments.
func parseArgs(fs *flag.FlagSet, args []string, stderr io.Writer) ([]string, error) {
	var pos []string
	for {
		if err := parse(fs, args, stderr); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos, args = append(pos, fs.Arg(0)), fs.Args()[1:]
	}
}

// parse parses flags, turning flag errors into usage errors.
func parse(fs *flag.FlagSet, args []string, stderr io.Writer) error {
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageErr("%s: %v", fs.Name(), err)
	}
	return nil
}

// jsonFlag registers --json.
func jsonFlag(fs *flag.FlagSet) *bool {
	return fs.Bool("json", false, "print JSON Lines (snake_case keys) instead of a table")
}

// printJSON prints each row as one line of JSON.
func printJSON[T any](w io.Writer, rows ...T) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false) // URLs and errors print as they are: & not \u0026
	for _, r := range rows {
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return nil
}
