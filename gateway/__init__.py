"""Front doors to the fleet for callers that do not speak AMQP. They publish turns and
control messages through the publisher client (``contracts.client``) like any other service,
and import ``contracts``, never ``worker``."""
