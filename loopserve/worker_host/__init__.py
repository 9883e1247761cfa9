"""What every worker shares: an engine on a step thread behind one lock, its events, records and KV transfer setup."""
