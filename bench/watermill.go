package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/internal/sqlident"
)

// saramaVersion is the protocol version Sarama speaks to kfake. Watermill's
// default (1.0.0) asks for request versions kfake no longer serves.
var saramaVersion = sarama.V3_6_0_0

// handClaim is the inbox claim a user writes by hand without oncely: insert
// the message id into the same inbox table, and report whether it was new.
func handClaim(k kafkaRun) func(ctx context.Context, tx pgx.Tx, it item) (bool, error) {
	sql := `INSERT INTO ` + sqlident.Table(k.db.schema, "inbox") + ` (consumer_group, message_id, topic, partition, "offset")
		VALUES ($1, $2, $3, $4, $5) ON CONFLICT (consumer_group, message_id) DO NOTHING`
	return func(ctx context.Context, tx pgx.Tx, it item) (bool, error) {
		tag, err := tx.Exec(ctx, sql, k.group, it.id, k.topic, it.part, it.off)
		return err == nil && tag.RowsAffected() == 1, err
	}
}

// runWatermill is the peer a user would otherwise pick: watermill-kafka's
// Sarama subscriber in a consumer group, behind watermill's Router, with the
// handler doing what oncely does by hand: in one pgx transaction, insert the
// message id into the same inbox table (ON CONFLICT DO NOTHING), skip the
// effect when the id was there, else insert the effect, commit, and ack.
func runWatermill(ctx context.Context, k kafkaRun) error {
	cfg := kafka.DefaultSaramaSubscriberConfig()
	cfg.Version = saramaVersion
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               k.env.brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: cfg,
		ConsumerGroup:         k.group,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return errors.Join(err, sub.Close())
	}
	claim := handClaim(k)
	router.AddConsumerHandler("bench", k.topic, sub, func(msg *message.Message) error {
		mctx := msg.Context()
		part, _ := kafka.MessagePartitionFromCtx(mctx)
		off, _ := kafka.MessagePartitionOffsetFromCtx(mctx)
		key, _ := kafka.MessageKeyFromCtx(mctx)
		amount, sent, err := decodeValue(msg.Payload)
		if err != nil {
			return err
		}
		it := item{id: msg.UUID, key: string(key), part: part, off: off, amount: amount, sent: sent}
		return pgx.BeginFunc(mctx, k.db.pool, func(tx pgx.Tx) error {
			if fresh, err := claim(mctx, tx, it); err != nil || !fresh {
				return err // a duplicate commits nothing new
			}
			return k.db.applyEffect(mctx, tx, it)
		})
	})
	if err := router.Run(ctx); err != nil {
		return fmt.Errorf("watermill router: %w", err)
	}
	return nil
}
