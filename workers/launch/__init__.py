"""Launch backends (`backends.start_run`) and the local engine supervisor. Imports nothing itself."""
