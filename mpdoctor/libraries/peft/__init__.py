"""What mpdoctor knows about PEFT."""
