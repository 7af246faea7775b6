//! GPU and Slurm telemetry.
