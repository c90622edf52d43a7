"""What-if: what a traffic profile would cost under a scenario, from measured throughput curves."""
