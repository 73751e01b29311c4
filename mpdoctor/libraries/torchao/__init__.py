"""What mpdoctor knows about torchao."""
