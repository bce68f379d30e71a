"""`kvpush demo`: prefill, decode and proxy servers run as processes and checked against one
instance (`run`). A tool over the serving stack; nothing below it imports it."""
