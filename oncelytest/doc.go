// Package oncelytest is a test kit for the users of oncely: it runs a
// consumer.Handler on a message in a transaction that is rolled back and
// says what the consumer would do with the result (processed, retried, or
// dead-lettered with which class), and it starts what an end-to-end test of
// a worker needs: an in-process Kafka broker (franz-go's kfake) and a
// throwaway, migrated Postgres schema.
//
// It is a module of its own, so that kfake reaches only the modules whose
// tests import it, never the graph of a module that imports the library
// alone.
//
// Run decides with consumer.Decide, the record path's own decision, so a
// test and production agree on what an error means. What Run does not do:
// it claims no inbox row (a duplicate delivery is the consumer's business,
// shown end to end with StartKafka and Schema), and it never commits, so
// it cannot see a failure of COMMIT itself other than a deferred
// constraint, which it checks before rolling back.
package oncelytest
