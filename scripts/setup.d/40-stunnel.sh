# stunnel terminates TLS in front of the external broker in
# outbox-cli/tests/managed_kafka.rs (the TLS tests fail, never skip, without it);
# openssl makes the test's certificates.
apt_install stunnel4 openssl
