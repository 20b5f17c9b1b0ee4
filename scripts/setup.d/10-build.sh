# librdkafka is built from source by rdkafka-sys: make, a C/C++ compiler,
# zlib, and OpenSSL for TLS and SASL SCRAM/OAUTHBEARER. OIDC (the
# client-credentials token request) needs libcurl: librdkafka's configure
# looks for it with pkg-config or by linking -lcurl, and finds neither the
# copy curl-sys builds from source (feature curl-static) nor the runtime
# library without its development package; without libcurl4-openssl-dev it
# builds silently without OIDC (measured on a machine without it:
# "checking for libcurl (by compile)... failed (disable)", then the OIDC
# test refused "sasl.oauthbearer.client.secret not supported in this build").
# pkg-config helps the C builds find their libraries.
apt_install make g++ pkg-config zlib1g-dev libssl-dev libcurl4-openssl-dev
