"""What mpdoctor knows about transformers."""
