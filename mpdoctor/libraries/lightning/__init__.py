"""What mpdoctor knows about Lightning."""
