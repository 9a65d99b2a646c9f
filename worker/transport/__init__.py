"""RabbitMQ: the consumer (the one place a delivery is settled), publishing, tool RPC, events, topology."""
