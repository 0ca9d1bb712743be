-- Reverts 0004_webhook_delivery.up.sql. Run with search_path set to the oncely schema.
DROP TABLE IF EXISTS webhook_breakers;
DROP TABLE IF EXISTS webhook_deliveries;
DROP TABLE IF EXISTS webhook_subscriptions;
