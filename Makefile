# Targets match the README. DATABASE_URL defaults to the local server that
# this project's machines run (trust auth, database "test").
DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test?sslmode=disable
export DATABASE_URL

GO ?= go
TEST_FLAGS ?= -race -count=1 -timeout 20m
FUZZTIME ?= 30s

# Every module's packages but the benchmark's. The root module is what users
# import; the nested modules (go.work lists them) hold what needs kfake or
# testcontainers: the integration tests, the example, and their test
# environment.
PKGS ?= ./... ./examples/... ./integration_test/... ./internal/testenv/... ./oncelytest/...

.PHONY: test-console-browser console-screenshots bench-console check-user-deps tidy-check demo example-payments test test-modes test-crashpoints test-soak test-containers fuzz bench bench-uncontended bench-contended bench-chaos bench-outbox bench-idempotency bench-nats bench-rabbit lint vet fmt-check

## demo: the main job: orderworker on embedded defaults (kfake in-process, local Postgres)
demo:
	$(GO) run ./examples/orderworker demo

## example-payments: the payments service of docs/QUICKSTART.md, built and tested end to
## end (oncelytest: an in-process Kafka and a schema of its own); make test runs it too
example-payments:
	$(GO) build -o /dev/null ./examples/payments
	$(GO) test $(TEST_FLAGS) ./examples/payments/

## test: every test of every module (PKGS), with the race detector, against DATABASE_URL and kfake
test:
	$(GO) test $(TEST_FLAGS) $(PKGS)

## test-modes: the integration suite again in batch mode and in per-key mode
## (make test runs it in record mode), so every exactly-once test covers every mode
test-modes:
	ONCELY_CONSUMER_MODE=batch $(GO) test $(TEST_FLAGS) ./integration_test/
	ONCELY_CONSUMER_MODE=perkey $(GO) test $(TEST_FLAGS) ./integration_test/

## test-crashpoints: the named crash-point tests (after DB commit, after the dead-letter
## produce, after the relay's produce, a zombie mid-handler) repeated, with -race,
## five times in record mode and twice in each of batch and per-key mode
test-crashpoints:
	$(GO) test -race -count=5 -timeout 20m -run 'Crash|Zombie' ./integration_test/
	ONCELY_CONSUMER_MODE=batch $(GO) test -race -count=2 -timeout 20m -run 'Crash|Zombie' ./integration_test/
	ONCELY_CONSUMER_MODE=perkey $(GO) test -race -count=2 -timeout 20m -run 'Crash|Zombie' ./integration_test/

## test-soak: the chaos soaks (docs/RELIABILITY.md), one after the other: TestSoak on Kafka
## (orderworker processes killed, stopped and restarted while broker and database faults are
## injected), and TestSoakJetStream and TestSoakRabbitMQ (the same processes on a nats-server and
## a RabbitMQ node of the test's own, their connections cut and stalled at a proxy and the broker
## killed and started again on the same store); each checks the whole history. ONCELY_SOAK_DURATION
## sets the length of each one's chaos (default 60s; a long run needs SOAK_TIMEOUT of three times
## the duration plus 20m), ONCELY_SOAK_SEED replays a run's schedules, ONCELY_SOAK_LOGS keeps the
## processes' logs (the broker soaks' in its subdirectories jetstream/ and rabbitmq/). Without
## -race: the workers are separate processes, and the test process hosts the Kafka brokers, which
## -race would slow down.
ONCELY_SOAK_DURATION ?= 60s
ONCELY_SOAK_SEED ?=
SOAK_TIMEOUT ?= 30m
test-soak:
	ONCELY_SOAK=1 ONCELY_SOAK_DURATION=$(ONCELY_SOAK_DURATION) ONCELY_SOAK_SEED=$(ONCELY_SOAK_SEED) \
		$(GO) test -count=1 -v -timeout $(SOAK_TIMEOUT) -run '^TestSoak(JetStream|RabbitMQ)?$$' ./integration_test/

## test-containers: the integration suite with DATABASE_URL unset, every Postgres
## started by testcontainers-go through podman (needs root: installs podman, runc
## and busybox-static if missing, builds localhost/oncely-postgres:15 locally).
## See scripts/test-containers.sh; arguments through TEST_CONTAINERS_ARGS.
test-containers:
	scripts/test-containers.sh $(TEST_CONTAINERS_ARGS)

## fuzz: every fuzz target of the module in turn, FUZZTIME each (default 30s;
## FUZZ_PARALLEL=1 leaves cores to others). A failing input is written to the
## package's testdata/fuzz/FuzzXxx/: commit it with the fix. See scripts/fuzz.sh.
fuzz:
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh

## bench: both workloads, one after the other (docs/BENCHMARKS.md). The nested module
## bench/ keeps Watermill and Sarama out of go.mod.
bench: bench-uncontended bench-contended

## bench-uncontended: each key's rows on one partition: the consumer against a raw-SQL
## ceiling, a naive at-least-once consumer and Watermill, in one run (kfake and
## DATABASE_URL), with the ratios and the targets. Flags through BENCH_FLAGS, e.g.
## BENCH_FLAGS='-modes oncely,batch -n 5000'.
bench-uncontended:
	cd bench && $(GO) run . $(BENCH_FLAGS)

## bench-contended: orders keyed by order id over 6 partitions, 50 customers, the
## orderworker's effects: a hand-written per-record worker, oncely per-record, batch
## with a per-record Handler, the example's BatchHandler and key parallelism, each
## with 1 and 3 members, and the set-based raw-SQL ceiling (docs/BENCHMARKS.md).
## Flags through CONTENDED_FLAGS, e.g. CONTENDED_FLAGS='-rounds 1 -members 1'.
bench-contended:
	cd bench && $(GO) run . -workload contended $(CONTENDED_FLAGS)

## bench-chaos: the example's default and the hand-written worker, 3 processes each,
## one killed every 1.5 s while 30,000 orders arrive over 10 s; rates beside the
## no-chaos rates and each restart's time to its first commit. Flags: CHAOS_FLAGS.
bench-chaos:
	cd bench && $(GO) run ./chaos $(CHAOS_FLAGS)

## bench-idempotency: the Idempotency-Key middleware on its Postgres and Redis stores against a
## hand-written Redis SET NX + GET version, in one run, with the ratios
bench-idempotency:
	cd bench && $(GO) run . idempotency $(IDEM_FLAGS)

## bench-nats: the NATS JetStream consumer, per message and in batch mode, against a
## hand-written JetStream consumer (pull Fetch, inbox insert, effect, commit, Ack), in one
## run, on the local nats-server (NATS_URL) and Postgres (docs/BENCHMARKS.md)
bench-nats:
	cd bench && $(GO) run . nats $(NATS_FLAGS)

## bench-rabbit: the RabbitMQ consumer, per message and in batch mode, against a hand-written
## amqp091-go consumer (manual ack, prefetch, inbox insert, effect, commit, ack), in one run, on
## quorum queues of the local RabbitMQ (AMQP_URL) and Postgres (docs/BENCHMARKS.md)
bench-rabbit:
	cd bench && $(GO) run . rabbit $(RABBIT_FLAGS)

## bench-outbox: the outbox relay against a raw-SQL ceiling, in one run, with the ratio
bench-outbox:
	$(GO) test -run '^$$' -bench BenchmarkOutbox -benchtime 20000x -count 1 ./integration_test/ | tee /tmp/oncely-bench.txt
	@awk '/raw-sql/ {raw=$$5} /relay/ {relay=$$5} END {if (raw > 0) printf "relay / raw-SQL ceiling = %.2f\n", relay/raw}' /tmp/oncely-bench.txt

## lint: formatting, vet and golangci-lint (fetched through the module proxy), in
## each module's directory (./... stops at a nested module)
lint: fmt-check vet
	for m in $(filter-out bench,$(TIDY_MODULES)); do (cd $$m && $(GO) run github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0 run ./...) || exit 1; done

## vet: every module, the benchmark's included; the root module also on its
## own (GOWORK=off), with the versions its go.mod gives users
vet:
	$(GO) vet $(PKGS)
	GOWORK=off $(GO) vet ./...
	cd bench && $(GO) vet ./...

## test-console-browser: the operator console in a real headless Chromium (Debian's
## chromium, installed by scripts/install-chromium.sh if missing): filter, redrive,
## retry and pause through the pages, effects checked in Postgres and Kafka; and a JetStream
## dead-letter stream's pages (the local nats-server) and a RabbitMQ dead-letter queue's (the
## local RabbitMQ)
test-console-browser:
	scripts/install-chromium.sh
	ONCELY_BROWSER_TEST=1 $(GO) test -race -count=1 -timeout 5m -run '^TestConsole(JetStream|RabbitMQ)?InBrowser$$' ./integration_test/

## bench-console: every console page rendered on 1,000,000 inbox rows, 100,000 outbox rows and
## 100,000 dead letters, beside the same queries' raw time, and the dead-letter pages of a
## JetStream stream and a RabbitMQ queue of 10,000 (ONCELY_CONSOLE_BENCH_SCALE scales them)
bench-console:
	$(GO) test -run '^$$' -bench 'BenchmarkConsole(Pages|JetStreamPages|RabbitPages)' -benchtime 3x -count 1 -timeout 20m ./integration_test/

## console-screenshots: the same tests, saving a PNG of each page into docs/console/ (the
## Kafka pages, and the JetStream and RabbitMQ ones prefixed jetstream- and rabbitmq-)
console-screenshots:
	scripts/install-chromium.sh
	ONCELY_BROWSER_TEST=1 ONCELY_CONSOLE_SCREENSHOTS=$(CURDIR)/docs/console $(GO) test -count=1 -timeout 5m -run '^TestConsole(JetStream|RabbitMQ)?InBrowser$$' ./integration_test/

## tidy-check: every module's go.mod and go.sum are tidy on their own (outside
## the workspace, as go mod tidy sees them)
TIDY_MODULES ?= . examples integration_test internal/testenv oncelytest bench
tidy-check:
	for m in $(TIDY_MODULES); do (cd $$m && GOWORK=off $(GO) mod tidy -diff) || { echo "tidy-check: run go mod tidy in $$m"; exit 1; }; done

## check-user-deps: a fresh module importing every library package pulls no
## testcontainers, docker, moby or kfake; prints its module and go.sum line
## counts (scripts/check-user-deps.sh)
check-user-deps:
	GO=$(GO) scripts/check-user-deps.sh

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
