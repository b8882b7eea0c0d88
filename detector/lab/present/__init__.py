"""What a person reads of the lab's records: tables and numbers, verdicts, cards, charts and timelines (PNG)."""
