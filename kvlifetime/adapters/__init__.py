"""Evidence from real transfer engines: each adapter says exactly what a raw status proves."""
