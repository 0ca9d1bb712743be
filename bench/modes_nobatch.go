//go:build !batchapi

package main

import (
	"context"
	"errors"
)

// runBatchMode stands in until consumer.Config has its batch and per-key
// options.
func (e *env) runBatchMode(_ context.Context, m string) result {
	return result{mode: m, err: errors.New("needs consumer.Config.BatchSize and KeyParallelism")}
}
