"""What mpdoctor knows about DeepSpeed."""
