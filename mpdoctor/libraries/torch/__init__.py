"""What mpdoctor knows about torch itself (its modules, optimizers, GradScaler; weight averaging; float8 weight storage)."""
