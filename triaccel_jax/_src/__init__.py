"""Private implementation of triaccel_jax; import from ``triaccel_jax`` instead."""
