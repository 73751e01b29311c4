"""What mpdoctor knows about bitsandbytes."""
