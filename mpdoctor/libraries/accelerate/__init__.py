"""What mpdoctor knows about accelerate."""
