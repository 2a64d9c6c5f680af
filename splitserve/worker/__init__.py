"""What both worker roles share: the engine on its thread, transports, KV-event outboxes."""
