package io.kthrottle.harness.telemetry;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardOpenOption;
import java.util.List;
import java.util.Map;

import org.apache.kafka.common.config.ConfigException;
import org.apache.kafka.common.metrics.KafkaMetric;
import org.apache.kafka.common.metrics.MetricsReporter;
import org.apache.kafka.server.authorizer.AuthorizableRequestContext;
import org.apache.kafka.server.telemetry.ClientTelemetryContext;
import org.apache.kafka.server.telemetry.ClientTelemetryExporter;
import org.apache.kafka.server.telemetry.ClientTelemetryExporterProvider;
import org.apache.kafka.server.telemetry.ClientTelemetryPayload;

/**
 * A broker metrics reporter that records every client telemetry push (KIP-714) it receives, one line each.
 *
 * Why: a Kafka broker offers GetTelemetrySubscriptions and PushTelemetry only when a reporter in
 * {@code metric.reporters} can take clients' metrics (Kafka 4.3's {@code DynamicMetricReporterState} adds
 * any {@link ClientTelemetryExporterProvider}, or the deprecated {@code ClientTelemetry}, to the
 * {@code ClientTelemetryExporterPlugin}; an empty plugin hides both APIs in ApiVersions). kthrottle's tests
 * need that, and need to see what the broker received: whose push it was, as the broker authenticated it.
 *
 * The file is named by the broker config {@value #FILE_CONFIG}. Each line holds tab-separated fields, in
 * this order (see harness/telemetry/__init__.py, which reads them): client instance id, client id,
 * principal, listener name, client address, terminating (true/false), content type, payload bytes,
 * push interval ms.
 */
public class TelemetryRecorder implements MetricsReporter, ClientTelemetryExporterProvider {

    /** The broker config naming the file this reporter appends to. */
    public static final String FILE_CONFIG = "kthrottle.telemetry.file";

    private volatile Path file;

    @Override
    public void configure(Map<String, ?> configs) {
        Object value = configs.get(FILE_CONFIG);
        if (value == null || value.toString().isEmpty()) {
            throw new ConfigException(FILE_CONFIG, value, "names the file where client telemetry pushes are recorded");
        }
        file = Paths.get(value.toString());
    }

    @Override
    public void init(List<KafkaMetric> metrics) {
    }

    @Override
    public void metricChange(KafkaMetric metric) {
    }

    @Override
    public void metricRemoval(KafkaMetric metric) {
    }

    @Override
    public void close() {
    }

    @Override
    public ClientTelemetryExporter clientTelemetryExporter() {
        return this::record;
    }

    private void record(ClientTelemetryContext context, ClientTelemetryPayload payload) {
        AuthorizableRequestContext request = context.authorizableRequestContext();
        String line = String.join("\t",
            String.valueOf(payload.clientInstanceId()),
            clean(request.clientId()),
            clean(String.valueOf(request.principal())),
            clean(request.listenerName()),
            request.clientAddress() == null ? "" : request.clientAddress().getHostAddress(),
            String.valueOf(payload.isTerminating()),
            clean(payload.contentType()),
            String.valueOf(payload.data() == null ? 0 : payload.data().remaining()),
            String.valueOf(context.pushIntervalMs())) + "\n";
        append(line);
    }

    /** Request handler threads push concurrently: one whole line at a time. */
    private synchronized void append(String line) {
        try {
            Files.write(file, line.getBytes(StandardCharsets.UTF_8),
                        StandardOpenOption.CREATE, StandardOpenOption.APPEND, StandardOpenOption.WRITE);
        } catch (IOException e) {
            throw new UncheckedIOException("cannot record a telemetry push in " + file, e);
        }
    }

    /** A client id is the client's choice: keep the line format whatever it holds. */
    private static String clean(String value) {
        return value == null ? "" : value.replaceAll("[\\t\\r\\n]", " ");
    }
}
