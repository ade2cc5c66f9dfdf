"""KV block transfer between processes and hosts: one interface, several backends."""
