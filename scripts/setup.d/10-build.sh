# librdkafka is built from source by rdkafka-sys: make, a C/C++ compiler,
# zlib, and OpenSSL for TLS and SASL SCRAM/OAUTHBEARER. OIDC (the
# client-credentials token request) needs libcurl, which cargo builds from
# source too (curl-sys, feature curl-static); .cargo/config.toml points
# librdkafka's configure at that copy (outbox-producer/build-support/pkg-config),
# so libcurl's development package is not installed here, and the build is
# the same whether the quickstart or this script ran first.
# pkg-config helps the C builds find their libraries.
apt_install make g++ pkg-config zlib1g-dev libssl-dev
