"""What makes the lab's records: a profile's trace read and measured, its steps modelled, the machine's load and the
allocator's figures read; and the timing loops, random cases and loss costs that the benches and `make shapes` share."""
