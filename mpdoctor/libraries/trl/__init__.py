"""What mpdoctor knows about TRL."""
